//! The agent's two credentials: every call must carry the collaborator
//! token and the internal host credential, and each call that does counts
//! as contact from the lifecycle (for the orphan bound).

use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Duration;

use automesh_rpc::auth::constant_time_eq;
use tonic::service::Interceptor;
use tonic::{Request, Status};

use crate::HOST_HEADER;

/// Admits only calls carrying both credentials.
#[derive(Clone)]
pub struct DualCredential {
    collaborator: Arc<str>,
    host: Arc<str>,
    pub(crate) contact: Contact,
}

/// When an authenticated call last arrived.
#[derive(Clone, Default)]
pub(crate) struct Contact(Arc<Mutex<Option<std::time::Instant>>>);

impl Contact {
    fn touch(&self) {
        *self.0.lock() = Some(std::time::Instant::now());
    }

    /// Time since the last call (or since `since`, before any call).
    pub(crate) fn silent_for(&self, since: std::time::Instant) -> Duration {
        self.0.lock().unwrap_or(since).elapsed()
    }
}

impl std::fmt::Debug for DualCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DualCredential(<redacted>)")
    }
}

impl DualCredential {
    pub fn new(collaborator: &str, host: &str) -> Self {
        Self {
            collaborator: Arc::from(format!("Bearer {collaborator}")),
            host: Arc::from(host),
            contact: Contact::default(),
        }
    }
}

impl Interceptor for DualCredential {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let has = |name: &str, want: &str| {
            req.metadata()
                .get(name)
                .is_some_and(|v| constant_time_eq(v.as_bytes(), want.as_bytes()))
        };
        if !has("authorization", &self.collaborator) {
            return Err(Status::unauthenticated(
                "missing or invalid collaborator token",
            ));
        }
        if !has(HOST_HEADER, &self.host) {
            return Err(Status::unauthenticated(
                "missing or invalid host credential",
            ));
        }
        self.contact.touch();
        Ok(req)
    }
}
