//! The operator's `/healthz` beats only when the API server answers its
//! list of DistBeliefJobs.

use std::time::Duration;

use distbelief_operator::health::{heartbeat, probe_once};
use http::{Request, Response};
use kube::api::{Api, DynamicObject};
use kube::client::Body;
use serde_json::json;

/// A fake API server answering every request with `code`; the paths asked.
async fn probe_against(code: u16) -> (bool, Vec<String>) {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let server = tokio::spawn(async move {
        let mut asked = Vec::new();
        while let Some((request, send)) = handle.next_request().await {
            asked.push(request.uri().to_string());
            let body = if code == 200 {
                json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadataList", "metadata": {}, "items": []})
            } else {
                json!({"apiVersion": "v1", "kind": "Status", "status": "Failure", "reason": "Forbidden", "code": code, "message": "forbidden"})
            };
            let reply = Response::builder()
                .status(code)
                .body(Body::from(serde_json::to_vec(&body).unwrap()))
                .unwrap();
            send.send_response(reply);
            if asked.len() == 1 {
                return asked;
            }
        }
        asked
    });
    let client = kube::Client::new(service, "default");
    let jobs: Api<DynamicObject> =
        Api::all_with(client, &distbelief_operator::reconcile::job_resource());
    let heart = heartbeat();
    let answered = tokio::time::timeout(Duration::from_secs(10), probe_once(&jobs, &heart))
        .await
        .expect("the probe has a deadline");
    (answered, server.await.expect("server"))
}

#[tokio::test]
async fn the_probe_beats_only_when_the_api_server_answers() {
    let (answered, asked) = probe_against(200).await;
    assert!(answered);
    assert_eq!(asked.len(), 1);
    assert!(
        asked[0].starts_with("/apis/distbelief.dev/v1alpha1/distbeliefjobs?")
            && asked[0].contains("limit=1"),
        "{asked:?}"
    );
    let (answered, _) = probe_against(403).await;
    assert!(!answered, "a refused list is no beat");
}
