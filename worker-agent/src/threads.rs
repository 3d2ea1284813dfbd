//! What the agent knows of its threads: one track per thread (its
//! message, whether it is busy, its outcome and events), indexed by message
//! id for observe-or-submit, and the thread a journaled message reports.

use std::collections::HashMap;

use automesh_domain::ErrorCode;
use automesh_proto::agent::v1 as apb;
use automesh_proto::v1 as pb;
use tokio_util::sync::CancellationToken;

/// The agent's journal of accepted messages (keyed by message id, the
/// thread id beside it), with each finished message's `Thread`.
pub(crate) type Journal = automesh_engine::journal::Record<apb::Thread>;

/// What a message a previous agent accepted, but never finished, reports.
pub(crate) fn interrupted(thread_id: &str, message_id: &str) -> apb::Thread {
    apb::Thread {
        thread_id: thread_id.to_owned(),
        message_id: message_id.to_owned(),
        status: apb::ThreadStatus::Idle as i32,
        outcome: pb::RunState::Failed as i32,
        error_code: ErrorCode::RuntimeInterrupted.as_str().to_owned(),
        error_message: "the worker agent stopped while the message executed; it is not run \
                        again, because its agent may already have acted"
            .into(),
        engine: "native-v1".into(),
        ..Default::default()
    }
}

pub(crate) struct Track {
    pub(crate) message_id: String,
    pub(crate) busy: bool,
    pub(crate) outcome: Option<(pb::RunState, String, String, pb::Usage)>,
    pub(crate) events: Vec<pb::RunEvent>,
    pub(crate) cancel: CancellationToken,
    /// Set for a message a previous agent journaled: what it reports.
    pub(crate) journaled: Option<apb::Thread>,
}

impl Track {
    pub(crate) fn thread(&self, thread_id: &str) -> apb::Thread {
        if let Some(t) = &self.journaled {
            return t.clone();
        }
        let (outcome, error_code, error_message, usage) = match &self.outcome {
            Some((s, c, m, u)) => (*s as i32, c.clone(), m.clone(), Some(*u)),
            None => (0, String::new(), String::new(), None),
        };
        apb::Thread {
            thread_id: thread_id.to_owned(),
            message_id: self.message_id.clone(),
            status: if self.busy {
                apb::ThreadStatus::Busy
            } else {
                apb::ThreadStatus::Idle
            } as i32,
            outcome,
            error_code,
            error_message,
            usage,
            last_sequence: self.events.len() as i64,
            engine: "native-v1".into(),
        }
    }
}

pub(crate) fn unknown(thread_id: &str) -> apb::Thread {
    apb::Thread {
        thread_id: thread_id.to_owned(),
        status: apb::ThreadStatus::Unknown as i32,
        ..Default::default()
    }
}

/// The agent's threads.
#[derive(Default)]
pub(crate) struct Threads {
    pub(crate) by_id: HashMap<String, Track>,
    pub(crate) by_message: HashMap<String, String>,
}
