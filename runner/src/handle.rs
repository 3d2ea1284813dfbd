//! What the runner does with each message the gateway sends about a run:
//! an assignment is held (journaled) and accepted, a confirmation starts it,
//! a refusal lets a held run go, a cancellation stops it or reports it idle
//! — each said in the run's trace, from what the journal keeps.

use std::sync::atomic::Ordering;

use prost::Message as _;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::{Runner, Up, assignment_span, execute, rpb, send, up};

impl Runner {
    pub(crate) async fn on_assignment(
        &self,
        a: rpb::Assignment,
        tx: &mpsc::Sender<rpb::ConnectRequest>,
    ) {
        let span = assignment_span("automesh.runner.assignment", &a);
        async {
            let run_id = a.run_id.clone();
            if let Some(run) = self.record.get(&run_id) {
                // Known already: never run again; tell the gateway where it is.
                self.stats.duplicates.fetch_add(1, Ordering::SeqCst);
                tracing::info!(run_id = %run_id, "assignment already held; not run again");
                let report = match run.finished {
                    Some(f) => Up::RunFinished(f),
                    None => Up::AssignmentAccepted(rpb::AssignmentAccepted { run_id }),
                };
                send(tx, up(report)).await;
                return;
            }
            // Held (synced) before it is accepted; started only once the
            // gateway confirms the acceptance (see `on_confirmed`).
            if let Err(error) = self.record.hold(&run_id, &a.encode_to_vec(), &a.traceparent) {
                // Not recorded, so not accepted: the gateway offers it again.
                tracing::error!(run_id = %run_id, %error, "cannot record the assignment; not accepting it");
                return;
            }
            tracing::info!(run_id = %run_id, "assignment held; accepting it");
            send(
                tx,
                up(Up::AssignmentAccepted(rpb::AssignmentAccepted { run_id })),
            )
            .await;
        }
        .instrument(span)
        .await;
    }

    /// The gateway recorded this runner's acceptance: a held run starts,
    /// journaled as accepted first. A confirmation of a run that already
    /// started, or that this runner let go, changes nothing.
    pub(crate) fn on_confirmed(&self, run_id: &str) {
        let Some(body) = self.record.get(run_id).and_then(|r| r.held) else {
            return;
        };
        let Ok(a) = rpb::Assignment::decode(body.as_slice()) else {
            let _in_run = self
                .run_span("automesh.runner.let_go", run_id)
                .map(tracing::Span::entered);
            tracing::error!(run_id, "the held assignment cannot be read; it is let go");
            self.record.let_go(run_id);
            return;
        };
        let span = assignment_span("automesh.runner.confirmed", &a);
        let _in_run = span.enter();
        match self.record.accept(run_id) {
            Ok(true) => {
                tracing::info!(run_id, "acceptance confirmed; the run starts");
                self.start(a);
            }
            Ok(false) => {}
            Err(error) => {
                // Not started: the acceptance is confirmed again after a
                // reconnect, and the run starts then.
                tracing::error!(run_id, %error, "cannot record the acceptance; the run does not start");
            }
        }
    }

    /// The gateway refused a report. A held run the gateway says is not
    /// this stream's was never started here: it is another runner's now.
    pub(crate) fn on_refusal(&self, e: &rpb::ProtocolError) {
        let _in_run = self
            .run_span("automesh.runner.refused", &e.run_id)
            .map(tracing::Span::entered);
        tracing::warn!(run_id = %e.run_id, code = %e.code, message = %e.message, "the gateway refused a report");
        if e.code == "not_assigned" && self.record.let_go(&e.run_id) {
            tracing::info!(run_id = %e.run_id, "a held run that never started is let go; another runner has it");
        }
    }

    /// A span of the runner's handling of a run its journal holds (held,
    /// running or finished), in the run's trace; `None` for a run it does
    /// not know.
    pub(crate) fn run_span(&self, name: &'static str, run_id: &str) -> Option<tracing::Span> {
        Some(self.record.get(run_id)?.span(name))
    }

    /// Starts the engine on an accepted run.
    pub(crate) fn start(&self, a: rpb::Assignment) {
        let run_id = a.run_id.clone();
        let cancel = CancellationToken::new();
        self.active.lock().insert(run_id.clone(), cancel.clone());
        self.stats.executions.fetch_add(1, Ordering::SeqCst);
        let span = tracing::info_span!("automesh.runner.run", run_id = %run_id, engine = self.engine.engine_id());
        automesh_telemetry::propagation::continue_trace(&span, Some(a.traceparent.as_str()));
        let engine = self.engine.clone();
        let record = self.record.clone();
        let active = self.active.clone();
        let outbox = self.outbox.clone();
        let task = tokio::spawn(
            execute::execute(engine, record, active, outbox, a, cancel).instrument(span),
        );
        {
            let mut engines = self.engines.lock();
            engines.retain(|e| !e.is_finished());
            engines.push(task.abort_handle());
        }
    }

    pub(crate) async fn on_cancel(
        &self,
        c: &rpb::CancelAssignment,
        tx: &mpsc::Sender<rpb::ConnectRequest>,
    ) {
        let token = self.active.lock().get(&c.run_id).cloned();
        // Said in the run's trace (the journal keeps it).
        let span = self.run_span("automesh.runner.cancel", &c.run_id);
        let in_run = |say: &dyn Fn()| match &span {
            Some(span) => span.in_scope(say),
            None => say(),
        };
        if let Some(token) = token {
            in_run(
                &|| tracing::info!(run_id = %c.run_id, reason = %c.reason, "cancelling the run"),
            );
            token.cancel();
            // `execute` reports idle once the engine has stopped.
            return;
        }
        // Nothing runs here: idle. A held run never started and is let go;
        // a finished run's result goes first, then the record of it can go.
        if self.record.let_go(&c.run_id) {
            in_run(
                &|| tracing::info!(run_id = %c.run_id, reason = %c.reason, "a held run that never started is let go"),
            );
        }
        if let Some(f) = self.record.get(&c.run_id).and_then(|r| r.finished) {
            send(tx, up(Up::RunFinished(f))).await;
        }
        send(
            tx,
            up(Up::IdleObserved(rpb::IdleObserved {
                run_id: c.run_id.clone(),
            })),
        )
        .await;
        self.record.forget(&c.run_id);
    }
}
