//! The live page: one self-contained HTML page at `/` on the coordinator's
//! HTTP port (the one `/metrics` is on), and `/api/status`, the JSON it
//! polls. A sampler looks at what the coordinator already knows (tracker,
//! shards, chains) a few times a second; every viewer gets that one JSON
//! text, so viewers cost the job nothing. When the job is done the last
//! picture is also saved as `live.html` in the output directory.

pub mod view;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{StatusCode, header};
use axum::response::{Html, IntoResponse};
use distbelief_api::Job;

use crate::Shared;
use view::{JobFacts, Journal, PushRates, Sample};

const INDEX: &str = include_str!("index.html");

/// The saved page's name in the output directory.
pub const SNAPSHOT_FILE: &str = "live.html";

/// How often the sampler looks. A replica's `restarting` can be shorter than
/// this (its new process reports and trains within half a second), so the
/// page's record of a restart is the process number, the restart count and
/// the events list, which come from counters and cannot be missed.
const SAMPLE_EVERY: Duration = Duration::from_millis(200);

/// The page's handle: made before the coordinator serves (the HTTP port
/// starts first), filled once it does.
#[derive(Clone, Debug, Default)]
pub struct LivePage {
    latest: Arc<Mutex<Option<Arc<str>>>>,
}

impl LivePage {
    /// `/` and `/api/status`, to be served beside `/metrics`.
    pub fn routes(&self) -> axum::Router {
        let latest = self.latest.clone();
        axum::Router::new()
            .route("/", axum::routing::get(|| async { Html(INDEX) }))
            .route(
                "/api/status",
                axum::routing::get(move || {
                    let json = latest.lock().unwrap_or_else(|p| p.into_inner()).clone();
                    async move {
                        match json {
                            Some(j) => (
                                [
                                    (header::CONTENT_TYPE, "application/json"),
                                    (header::CACHE_CONTROL, "no-store"),
                                ],
                                j.to_string(),
                            )
                                .into_response(),
                            None => (
                                StatusCode::SERVICE_UNAVAILABLE,
                                "the coordinator is reading the job's data",
                            )
                                .into_response(),
                        }
                    }
                }),
            )
    }

    fn set(&self, json: String) {
        *self.latest.lock().unwrap_or_else(|p| p.into_inner()) = Some(json.into());
    }
}

/// The page's facts about the job itself.
pub(crate) fn facts(job: &Job) -> JobFacts {
    // AUC is scored for the models with tables (binary labels), and is
    // then the figure the page plots.
    let auc = !job.tables.is_empty();
    let stop = &job.spec.stop;
    JobFacts {
        name: job.name.clone(),
        metric: if auc { "auc" } else { "accuracy" },
        target: if auc {
            stop.target_test_auc
        } else {
            stop.target_test_accuracy
        },
        spec: shown_spec(&job.spec),
    }
}

/// The spec as the page shows it: without the roles' pod templates, whose
/// env values, volumes and annotations are where people put credentials,
/// and which say nothing about how the run goes. The page is open to
/// anyone who reaches the coordinator's HTTP port.
fn shown_spec(spec: &distbelief_api::DistBeliefJobSpec) -> serde_json::Value {
    let mut v = serde_json::to_value(spec).unwrap_or_default();
    for role in ["parameterServers", "replicas", "coordinator"] {
        if let Some(r) = v.get_mut(role).and_then(|r| r.as_object_mut())
            && r.remove("template").is_some()
        {
            r.insert("template".into(), "(set; not shown)".into());
        }
    }
    v
}

fn sample(shared: &Shared) -> Sample {
    let at = shared.now();
    let (status, staleness) = {
        let t = shared.tracker();
        (t.status(at), t.staleness().buckets().collect())
    };
    Sample {
        at,
        status: shared.finish_status(status),
        shards: shared.shards(),
        chains: shared
            .chains
            .as_ref()
            .map(|k| k.chains())
            .unwrap_or_default(),
        staleness,
    }
}

/// Samples the coordinator until `stop` fires, then takes a last sample, so
/// that a coordinator stopped right after the job is done still saves the
/// final picture.
pub(crate) async fn keep(
    page: LivePage,
    shared: Arc<Shared>,
    facts: JobFacts,
    snapshot_dir: Option<PathBuf>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    let (mut rates, mut journal) = (PushRates::default(), Journal::default());
    let mut prev: Option<Sample> = None;
    // What the saved page showed: its curve points and events. Saved again
    // only when they change (a last evaluation after the stop), not at
    // every sample while a finished coordinator waits to be stopped.
    let mut saved: Option<(usize, u64)> = None;
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        let last = tokio::select! {
            _ = tick.tick() => false,
            _ = &mut stop => true,
        };
        let s = sample(&shared);
        rates.observe(&s.shards, s.at);
        if let Some(p) = &prev {
            journal.record(p, &s);
        }
        let json = view::view(&facts, &s, &rates, &journal).to_string();
        let shown = (s.status.curve.len(), journal.recorded());
        if s.status.done
            && let Some(dir) = &snapshot_dir
            && saved != Some(shown)
        {
            save(dir, &json);
            saved = Some(shown);
        }
        page.set(json);
        if last {
            return;
        }
        prev = Some(s);
    }
}

/// Writes the page with its picture as `live.html` in `dir`, whole or not
/// at all: a reader never finds half a page.
fn save(dir: &std::path::Path, json: &str) {
    let (path, part) = (dir.join(SNAPSHOT_FILE), dir.join(".live.html.part"));
    let written =
        std::fs::write(&part, snapshot(json)).and_then(|()| std::fs::rename(&part, &path));
    if let Err(e) = written {
        tracing::warn!(path = %path.display(), "cannot save the live page: {e}");
    }
}

/// The page with its last picture inside, readable with no coordinator.
pub fn snapshot(json: &str) -> String {
    // `<` escaped, so that no text in the spec can close the script early.
    let data = json.replace('<', "\\u003c");
    INDEX.replace(
        "<!--SNAPSHOT-->",
        &format!("<script>window.SNAPSHOT = {data};</script>"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_saved_page_carries_its_picture_and_cannot_be_broken_out_of() {
        let page = snapshot(r#"{"job":"</script><script>alert(1)</script>"}"#);
        assert!(page.contains("window.SNAPSHOT = {\"job\":\"\\u003c/script>"));
        assert_eq!(page.matches("</script>").count(), 2, "{page}");
    }

    #[test]
    fn the_page_shows_no_pod_template_of_any_role() {
        let template =
            "template: {spec: {containers: [{name: x, env: [{name: TOKEN, value: hunter2}]}]}}";
        let yaml = format!(
            "apiVersion: distbelief.dev/v1alpha1\nkind: DistBeliefJob\nmetadata: {{name: j}}\nspec:\n  model: {{inputSize: 4, output: {{units: 2}}}}\n  algorithm: {{downpour: {{learningRate: 0.1}}}}\n  parameterServers: {{shards: 1, {template}}}\n  replicas: {{count: 1, {template}}}\n  coordinator: {{{template}}}\n"
        );
        let job = distbelief_api::parse_job("job.yaml", &yaml).expect("job");
        let shown = facts(&job).spec;
        let text = shown.to_string();
        assert!(
            !text.contains("hunter2") && !text.contains("TOKEN"),
            "{text}"
        );
        assert_eq!(shown["replicas"]["template"], "(set; not shown)");
        assert_eq!(shown["replicas"]["count"], 1, "the rest is shown");
    }

    #[test]
    fn the_page_fetches_nothing_from_elsewhere() {
        for needle in ["src=\"http", "href=\"http", "@import", "url(http"] {
            assert!(!INDEX.contains(needle), "{needle}");
        }
        assert!(INDEX.contains("<!--SNAPSHOT-->"));
    }
}
