//! Driving runs: the claim loop and one drive per claimed run.
//!
//! A coordinator leases live runs (any replica may hold any run; a lease
//! that stops being renewed expires and another coordinator takes the run
//! over). A drive persists the run's message identity before it first
//! submits, asks the placement's executor to start (or, on takeover, to
//! observe) that exact message, records the executor's events and status,
//! and ends the run with one receipt. Every wait is bounded: by the run's
//! deadline, by the cancellation bound, or by the lease.

mod claim;
mod ending;
mod execute;
mod lease;
mod outcome;

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use automesh_domain::{ModelCatalog, ModelSpec, Placement, Price, Run};
use automesh_proto::executor::v1::executor_service_client::ExecutorServiceClient;
use automesh_rpc::InternalChannel;
use automesh_store::{Store, StoreError};
use chrono::{DateTime, Utc};
use tokio_util::sync::CancellationToken;

pub use claim::run_loop;

/// How the claim loop and its drives behave.
#[derive(Debug, Clone)]
pub struct Settings {
    /// How long a lease lasts without a heartbeat; renewed every third of it.
    pub lease: Duration,
    /// How long to wait for an executor to be observed idle after a
    /// cancellation before ending the run with `cancel_unobserved`.
    pub cancel_bound: Duration,
    /// How often to look for claimable runs when nothing wakes the loop.
    pub poll: Duration,
    /// How many runs one coordinator drives at once.
    pub max_concurrent: usize,
    /// Bound on one unary executor call.
    pub call_timeout: Duration,
    /// How long past its deadline a submitted run waits for a coordinator
    /// with its executor before any coordinator ends it.
    pub orphan_grace: Duration,
    /// The model catalogue: the provider name each run's model is asked
    /// for, and the price its usage is charged at.
    pub models: Arc<ModelCatalog>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(15),
            cancel_bound: Duration::from_secs(30),
            poll: Duration::from_millis(500),
            max_concurrent: 1024,
            call_timeout: Duration::from_secs(10),
            orphan_grace: Duration::from_secs(300),
            models: Arc::new(ModelCatalog::development()),
        }
    }
}

/// The executors of each placement.
#[derive(Debug, Clone, Default)]
pub struct Executors {
    pub desktop: Option<ExecutorServiceClient<InternalChannel>>,
    pub cloud: Option<ExecutorServiceClient<InternalChannel>>,
}

impl Executors {
    /// The placements this coordinator can execute.
    pub fn placements(&self) -> Vec<Placement> {
        let mut out = vec![];
        if self.desktop.is_some() {
            out.push(Placement::Desktop);
        }
        if self.cloud.is_some() {
            out.push(Placement::Cloud);
        }
        out
    }

    pub(super) fn for_placement(
        &self,
        p: Placement,
    ) -> Option<ExecutorServiceClient<InternalChannel>> {
        match p {
            Placement::Desktop => self.desktop.clone(),
            Placement::Cloud => self.cloud.clone(),
        }
    }
}

/// What the drives of one coordinator share.
#[derive(Debug)]
pub struct Context {
    pub store: Store,
    pub executors: Executors,
    pub settings: Settings,
    /// This coordinator's lease identity.
    pub owner: String,
    /// The cancellation signal of every run this replica drives.
    pub active: Mutex<HashMap<String, CancellationToken>>,
}

impl Context {
    /// Tells this replica's drive of `run_id`, if it has one, that a
    /// cancellation was requested (other replicas learn it from their next
    /// heartbeat).
    pub fn signal_cancel(&self, run_id: &str) {
        if let Some(token) = self.active.lock().get(run_id).cloned() {
            token.cancel();
        }
    }
}

/// Why a drive stopped without ending the run.
#[derive(Debug)]
pub(super) enum Stop {
    /// Another coordinator holds the run now.
    LeaseLost,
    Store(StoreError),
}

impl From<StoreError> for Stop {
    fn from(e: StoreError) -> Self {
        Stop::Store(e)
    }
}

pub(super) fn sleep_until(t: DateTime<Utc>) -> tokio::time::Sleep {
    tokio::time::sleep((t - Utc::now()).to_std().unwrap_or(Duration::ZERO))
}

impl Context {
    /// The catalogue entry of the run's model (a model removed from the
    /// catalogue since the run was created has none: its run is unpriced).
    pub(super) fn model(&self, run: &Run) -> Option<&ModelSpec> {
        self.settings.models.get(&run.model)
    }

    pub(super) fn price(&self, run: &Run) -> Option<Price> {
        self.model(run).and_then(|m| m.price)
    }
}
