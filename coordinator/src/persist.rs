//! The tracker's state, saved while the job runs so that a restarted
//! coordinator goes on where the last one was: locally in the run
//! directory, on Kubernetes in a ConfigMap the job owns. Progress is
//! published only from a state already saved, so what users saw never runs
//! ahead of what a restarted coordinator restores: published progress never
//! goes backwards.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use distbelief_proto::v1::TrackerState;
use prost::Message;

use crate::{Shared, Tracker};

/// Larger saved states are refused rather than read: a ConfigMap holds at
/// most 1 MiB, and the saved curve is thinned to stay well under it.
pub const MAX_STATE_BYTES: usize = 1 << 20;

/// How long a starting coordinator keeps trying to read a saved state that
/// is there but cannot be read yet (the API server is away).
const LOAD_PATIENCE: Duration = Duration::from_secs(60);

/// Where the tracker's state is kept.
#[derive(Debug, Clone)]
pub enum StateStore {
    /// A file, replaced whole on every save (written beside it, then renamed).
    File(PathBuf),
    #[cfg(feature = "kubernetes")]
    ConfigMap(crate::kubernetes::Target),
}

/// Decodes a saved state, refusing one too large to have been saved.
pub fn decode(bytes: &[u8]) -> Result<TrackerState, String> {
    if bytes.len() > MAX_STATE_BYTES {
        return Err(format!(
            "{} bytes, more than the {MAX_STATE_BYTES} a saved state may have",
            bytes.len()
        ));
    }
    TrackerState::decode(bytes).map_err(|e| format!("not a saved tracker state: {e}"))
}

/// Why a saved state could not be loaded.
#[derive(Debug)]
pub enum LoadError {
    /// Worth trying again: the store could not be reached.
    Unavailable(String),
    /// The state is there and wrong; trying again would not help.
    Invalid(String),
}

impl StateStore {
    /// The saved state, or None when nothing was saved yet.
    pub async fn load(&self) -> Result<Option<TrackerState>, LoadError> {
        match self {
            StateStore::File(path) => {
                // Sized before it is read: a huge file is refused, not loaded.
                match std::fs::metadata(path) {
                    Ok(m) if m.len() > MAX_STATE_BYTES as u64 => {
                        return Err(LoadError::Invalid(format!(
                            "{}: {} bytes, more than the {MAX_STATE_BYTES} a saved state may have",
                            path.display(),
                            m.len()
                        )));
                    }
                    _ => {}
                }
                let bytes = match std::fs::read(path) {
                    Ok(b) => b,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                    Err(e) => {
                        return Err(LoadError::Invalid(format!(
                            "cannot read {}: {e}",
                            path.display()
                        )));
                    }
                };
                decode(&bytes)
                    .map(Some)
                    .map_err(|e| LoadError::Invalid(format!("{}: {e}", path.display())))
            }
            #[cfg(feature = "kubernetes")]
            StateStore::ConfigMap(target) => crate::kubernetes::load_state(target).await,
        }
    }

    pub async fn save(&self, state: &TrackerState) -> Result<(), String> {
        let bytes = state.encode_to_vec();
        match self {
            StateStore::File(path) => {
                let tmp = path.with_extension("tmp");
                std::fs::write(&tmp, &bytes)
                    .and_then(|()| std::fs::rename(&tmp, path))
                    .map_err(|e| format!("cannot write {}: {e}", path.display()))
            }
            #[cfg(feature = "kubernetes")]
            StateStore::ConfigMap(target) => crate::kubernetes::save_state(target, bytes).await,
        }
    }

    /// Loads, trying again while the store is unavailable, for at most
    /// [`LOAD_PATIENCE`]. A state saved for another job (`job_uid`) is left alone.
    pub async fn load_patiently(&self, job_uid: &str) -> Result<Option<TrackerState>, String> {
        let deadline = Instant::now() + LOAD_PATIENCE;
        let mut backoff = distbelief_net::Backoff::default();
        loop {
            match self.load().await {
                Ok(Some(s)) if !job_uid.is_empty() && s.job_uid != job_uid => {
                    tracing::warn!(
                        saved_for = s.job_uid,
                        "the saved tracker state belongs to an earlier job of this name; starting afresh"
                    );
                    return Ok(None);
                }
                Ok(s) => return Ok(s),
                Err(LoadError::Invalid(e)) => return Err(e),
                Err(LoadError::Unavailable(e)) if Instant::now() < deadline => {
                    tracing::warn!("cannot read the saved tracker state yet, will retry: {e}");
                    tokio::time::sleep(backoff.next_delay()).await;
                }
                Err(LoadError::Unavailable(e)) => {
                    return Err(format!(
                        "the saved tracker state could not be read for {LOAD_PATIENCE:?}: {e}"
                    ));
                }
            }
        }
    }
}

/// Restores `tracker` from what `store` holds, if anything; the saved
/// state, whose clock the coordinator's continues from and whose chains
/// the chain keeper starts from.
pub(crate) async fn restore(
    store: &StateStore,
    job_uid: &str,
    tracker: &mut Tracker,
) -> Result<Option<TrackerState>, String> {
    let Some(saved) = store.load_patiently(job_uid).await? else {
        return Ok(None);
    };
    tracker
        .restore(&saved)
        .map_err(|e| format!("the saved tracker state ({store:?}): {e}"))?;
    let status = tracker.status(saved.at);
    tracing::info!(
        seconds = format!("{:.1}", status.train_seconds),
        examples = status.examples,
        evaluations = status.curve.len(),
        done = tracker.is_done(),
        generation = tracker.generation(),
        "restored the tracker a previous coordinator saved"
    );
    Ok(Some(saved))
}

/// Saves the tracker's state every `save_every` and, at most every
/// `publish_every`, publishes the progress of a state just saved (on
/// Kubernetes, into the job's status). A save that fails publishes nothing,
/// so that nothing shown is lost on a restart.
pub(crate) async fn keep(shared: Arc<Shared>, save_every: Duration, publish_every: Duration) {
    let mut tick = tokio::time::interval(save_every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    #[cfg(feature = "kubernetes")]
    let mut publisher = shared
        .publish
        .clone()
        .map(crate::kubernetes::Publisher::new);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shared.save_now.notified() => {}
        }
        // No chain changes while the state is read and saved: a save of
        // the book as it was must not land after one of a newer book.
        let changes = match &shared.chains {
            Some(k) => Some(k.hold().await),
            None => None,
        };
        let (state, status) = shared.state_and_status(shared.now());
        if shared.store.is_some() {
            if let Err(e) = shared.save(state).await {
                // The end is shown all the same: a job must not hang on a
                // full disk or a deleted ConfigMap. Only then may a restart
                // show less than was shown.
                if !status.done {
                    tracing::warn!("cannot save the tracker state, will retry: {e}");
                    continue;
                }
                tracing::error!("cannot save the final tracker state; showing it unsaved: {e}");
            }
            *shared.shown.lock().unwrap_or_else(|p| p.into_inner()) = Some(status.clone());
        }
        drop(changes);
        #[cfg(feature = "kubernetes")]
        if let Some(p) = publisher.as_mut()
            && (status.done || p.due(publish_every))
        {
            p.publish(&shared, &status).await;
        }
        #[cfg(not(feature = "kubernetes"))]
        let _ = (status, publish_every);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_file_store_gives_back_what_it_saved_and_refuses_garbage() {
        let dir = std::env::temp_dir().join(format!("db-tracker-state-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let store = StateStore::File(dir.join("tracker.pb"));
        assert!(store.load_patiently("").await.unwrap().is_none());
        let state = TrackerState {
            at: 12.5,
            started: Some(1.0),
            job_uid: "u1".into(),
            ..TrackerState::default()
        };
        store.save(&state).await.unwrap();
        assert_eq!(store.load_patiently("").await.unwrap(), Some(state.clone()));
        assert_eq!(store.load_patiently("u1").await.unwrap(), Some(state));
        assert_eq!(store.load_patiently("u2").await.unwrap(), None);
        std::fs::write(dir.join("tracker.pb"), b"\xff\xff\xff").unwrap();
        let e = store.load_patiently("").await.unwrap_err();
        assert!(
            e.contains("tracker.pb") && e.contains("not a saved tracker state"),
            "{e}"
        );
        std::fs::write(dir.join("tracker.pb"), vec![0u8; MAX_STATE_BYTES + 1]).unwrap();
        assert!(
            store
                .load_patiently("")
                .await
                .unwrap_err()
                .contains("more than")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
