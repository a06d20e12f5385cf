//! No adoption by name, against the real API server: objects that carry a
//! name one of a job's children would take are left exactly as they were,
//! and the job says which and why.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Secret, Service};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::{Value, json};

use crate::kit::{self, create_job, example_job, status, wait_for};

/// The job's condition of `kind` once it has `status` ("True"/"False").
async fn condition(kit: &kit::Kit, ns: &str, job: &str, kind: &str, want: &str) -> Value {
    wait_for(
        Duration::from_secs(120),
        &format!("{kind}={want} on {job}"),
        || async {
            let st = status(kit, ns, job).await;
            st["conditions"]
                .as_array()?
                .iter()
                .find(|c| c["type"] == kind && c["status"] == want)
                .cloned()
        },
    )
    .await
}

#[tokio::test]
async fn kit_a_job_never_takes_over_an_object_of_its_children_s_name() {
    let Some(kit) = kit::kit("kit_ownership").await else {
        return;
    };
    let (ns, _gone) = kit.namespace("cp-owner").await;
    let mine = PatchParams::apply("kit-user");
    // The namespace's own deny-all policy, and a Service its owner made.
    let policies: Api<NetworkPolicy> = Api::namespaced(kit.client.clone(), &ns);
    let deny = json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "web"},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress"]},
    });
    let deny = policies
        .patch("web", &mine, &Patch::Apply(deny))
        .await
        .expect("policy created");
    let services: Api<Service> = Api::namespaced(kit.client.clone(), &ns);
    let theirs = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "api-coordinator"},
        "spec": {"selector": {"app": "api"}, "ports": [{"port": 80}]},
    });
    let theirs = services
        .patch("api-coordinator", &mine, &Patch::Apply(theirs))
        .await
        .expect("service created");

    // A Secret under the name of a job's credentials: the job must neither
    // replace it nor give its pods a CA that someone else holds the key of.
    let secrets: Api<Secret> = Api::namespaced(kit.client.clone(), &ns);
    let planted = json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "sec-distbelief-tls"},
        "stringData": {"ca.crt": "not ours"},
    });
    let planted = secrets
        .patch("sec-distbelief-tls", &mine, &Patch::Apply(planted))
        .await
        .expect("secret created");

    let _op = kit.operator(&ns, "solo", &["--network-policy", "true"]);
    // A job named after the policy: its own policy has another name.
    create_job(&kit, &ns, &example_job("web")).await;
    // A job whose coordinator Service would be `api-coordinator`.
    create_job(&kit, &ns, &example_job("api")).await;
    create_job(&kit, &ns, &example_job("sec")).await;

    let refused = condition(&kit, &ns, "sec", "ChildrenApplied", "False").await;
    assert_eq!(refused["reason"], "NotOwned", "{refused}");
    let message = refused["message"].as_str().unwrap_or("");
    assert!(
        message.starts_with("Secret sec-distbelief-tls already exists and is not this job's"),
        "{message}"
    );

    let refused = condition(&kit, &ns, "api", "ChildrenApplied", "False").await;
    assert_eq!(refused["reason"], "NotOwned", "{refused}");
    let message = refused["message"].as_str().unwrap_or("");
    assert!(
        message.starts_with(
            "Service api-coordinator already exists and is not this job's (it has no controller)"
        ),
        "{message}"
    );
    let events: Api<Event> = Api::namespaced(kit.client.clone(), &ns);
    // One NotOwned event per refused job, in no set order: each names its object.
    for object in ["Service api-coordinator", "Secret sec-distbelief-tls"] {
        wait_for(Duration::from_secs(30), "a NotOwned event", || async {
            let listed = events.list(&ListParams::default()).await.ok()?;
            listed.items.into_iter().find(|e| {
                e.reason.as_deref() == Some("NotOwned")
                    && e.note.as_deref().is_some_and(|n| n.contains(object))
            })
        })
        .await;
    }

    // The job named after the policy got its own and left the policy be.
    let own = wait_for(
        Duration::from_secs(60),
        "the job's NetworkPolicy",
        || async { policies.get("web-distbelief").await.ok() },
    )
    .await;
    let uid = kit.jobs(&ns).get("web").await.expect("job").uid();
    assert_eq!(own.owner_references().first().map(|o| o.uid.clone()), uid);
    let policy = policies.get("web").await.expect("the namespace's policy");
    assert_eq!(
        policy.resource_version(),
        deny.resource_version(),
        "untouched"
    );
    assert!(policy.owner_references().is_empty());
    // Both objects are as their owner left them, after the operator's retries.
    let service = services.get("api-coordinator").await.expect("the service");
    assert_eq!(
        service.resource_version(),
        theirs.resource_version(),
        "untouched"
    );
    assert!(service.owner_references().is_empty());
    let secret = secrets.get("sec-distbelief-tls").await.expect("the secret");
    assert_eq!(
        secret.resource_version(),
        planted.resource_version(),
        "untouched"
    );
    // The job named after the policy minted its own credentials: owned,
    // immutable, with the CA and the coordinator's and shards' certificates.
    let own = secrets
        .get("web-distbelief-tls")
        .await
        .expect("the job's secret");
    assert_eq!(own.owner_references().first().map(|o| o.uid.clone()), uid);
    assert_eq!(own.immutable, Some(true));
    let keys: Vec<&String> = own.data.as_ref().expect("data").keys().collect();
    assert_eq!(
        keys,
        [
            "ca.crt",
            "ca.key",
            "coordinator.crt",
            "coordinator.key",
            "shard-all.crt",
            "shard-all.key"
        ]
    );

    // Once the Service is gone, a retry applies the job's own.
    services
        .delete("api-coordinator", &Default::default())
        .await
        .expect("deleted");
    condition(&kit, &ns, "api", "ChildrenApplied", "True").await;
    let now = services
        .get("api-coordinator")
        .await
        .expect("the job's service");
    let job = kit.jobs(&ns).get("api").await.expect("job").uid();
    assert_eq!(now.owner_references().first().map(|o| o.uid.clone()), job);
}
