//! How a run ends, as pure functions of what was observed: the ending an
//! executor reported, a cancellation's ending, and the desktop endings of a
//! run no runner took (`runner_offline`, `runner_unresponsive`).

use automesh_domain::{ErrorCode, Placement, RunState, Usage};
use automesh_edge::convert;
use automesh_proto::executor::v1 as epb;

/// How a run ends.
#[derive(Debug, Clone)]
pub(super) struct Ending {
    pub(super) state: RunState,
    pub(super) code: Option<ErrorCode>,
    pub(super) message: Option<String>,
    pub(super) engine: Option<String>,
    pub(super) usage: Usage,
    pub(super) wake_micros: i64,
    pub(super) admission_micros: i64,
    pub(super) thread: Option<automesh_proto::v1::NativeThread>,
}

impl Ending {
    pub(super) fn new(
        state: RunState,
        code: Option<ErrorCode>,
        message: impl Into<String>,
    ) -> Self {
        Ending {
            state,
            code,
            message: Some(message.into()),
            engine: None,
            usage: Usage::default(),
            wake_micros: 0,
            admission_micros: 0,
            thread: None,
        }
    }
}

/// Why a cancellation was sent to the executor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CancelCause {
    User,
    Deadline,
    /// The run's usage, as its executor reported it, went over its budget
    /// per run (an executor that does not stop it itself).
    Budget,
}

pub(super) fn ran_on_executor(status: Option<&epb::ExecutionStatus>) -> bool {
    status.is_some_and(|s| {
        matches!(
            epb::ExecutionPhase::try_from(s.phase),
            Ok(epb::ExecutionPhase::Running | epb::ExecutionPhase::Finished)
        )
    })
}

/// A desktop run that reached its deadline without any runner accepting it
/// ends `runner_offline` (SPEC §6), or `runner_unresponsive` when a runner
/// of the owner was sent it and never accepted it; anything else keeps its
/// ending.
pub(super) fn offline_unless(
    ran: bool,
    unaccepted: bool,
    placement: Placement,
    cause: CancelCause,
    ending: Ending,
) -> Ending {
    if ran || placement != Placement::Desktop || !matches!(cause, CancelCause::Deadline) {
        return ending;
    }
    if unaccepted {
        return Ending::new(
            RunState::TimedOut,
            Some(ErrorCode::RunnerUnresponsive),
            "a runner of the owner was sent the run and never accepted it, and no other runner took it before its deadline",
        );
    }
    Ending::new(
        RunState::TimedOut,
        Some(ErrorCode::RunnerOffline),
        "no runner of the owner took the run before its deadline",
    )
}

pub(super) fn cancelled(cause: CancelCause, idle_observed: bool) -> Ending {
    match (cause, idle_observed) {
        (CancelCause::Deadline, true) => Ending::new(
            RunState::TimedOut,
            Some(ErrorCode::DeadlineExceeded),
            "the run reached its deadline and was cancelled on its executor",
        ),
        (CancelCause::Deadline, false) => Ending::new(
            RunState::TimedOut,
            Some(ErrorCode::DeadlineExceeded),
            "the run reached its deadline; its executor was not observed idle after cancellation",
        ),
        (CancelCause::User, true) => Ending::new(
            RunState::Cancelled,
            None,
            "cancelled by the user; the executor is idle",
        ),
        (CancelCause::User, false) => Ending::new(
            RunState::Cancelled,
            Some(ErrorCode::CancelUnobserved),
            "cancelled by the user; the executor was not observed idle within the cancellation bound",
        ),
        (CancelCause::Budget, true) => Ending::new(
            RunState::Failed,
            Some(ErrorCode::BudgetExceeded),
            "the run's reported usage went over its budget per run; the coordinator cancelled it on its executor",
        ),
        (CancelCause::Budget, false) => Ending::new(
            RunState::Failed,
            Some(ErrorCode::BudgetExceeded),
            "the run's reported usage went over its budget per run; its executor was not observed idle after cancellation",
        ),
    }
}

/// The ending an executor reported, if it reported one.
pub(super) fn finished(
    status: Option<&epb::ExecutionStatus>,
    cancel: Option<CancelCause>,
) -> Option<Ending> {
    let status = status?;
    if status.phase != epb::ExecutionPhase::Finished as i32 {
        return None;
    }
    let outcome = status.outcome.clone().unwrap_or_default();
    let reported = convert::run_state_from_pb(outcome.state).unwrap_or(RunState::Failed);
    let code = outcome.error_code.parse::<ErrorCode>().ok();
    let (state, code) = match (reported, cancel) {
        (RunState::Cancelled | RunState::TimedOut, Some(CancelCause::Deadline))
        | (RunState::TimedOut, _) => (RunState::TimedOut, Some(ErrorCode::DeadlineExceeded)),
        (RunState::Succeeded, _) => (RunState::Succeeded, None),
        (RunState::Cancelled, Some(CancelCause::Budget)) => {
            (RunState::Failed, Some(ErrorCode::BudgetExceeded))
        }
        (RunState::Cancelled, _) => (RunState::Cancelled, None),
        (_, _) => (RunState::Failed, code.or(Some(ErrorCode::Internal))),
    };
    let usage = outcome.usage.unwrap_or_default();
    Some(Ending {
        state,
        code,
        message: (!outcome.error_message.is_empty()).then(|| outcome.error_message.clone()),
        engine: (!outcome.engine.is_empty()).then(|| outcome.engine.clone()),
        usage: convert::usage_from_pb(&usage),
        wake_micros: outcome.wake_micros,
        admission_micros: outcome.admission_micros,
        thread: outcome.native_thread,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(phase: epb::ExecutionPhase, outcome: Option<epb::Outcome>) -> epb::ExecutionStatus {
        epb::ExecutionStatus {
            phase: phase as i32,
            outcome,
            ..Default::default()
        }
    }

    fn outcome(state: automesh_proto::v1::RunState, code: &str) -> epb::Outcome {
        epb::Outcome {
            state: state as i32,
            error_code: code.into(),
            ..Default::default()
        }
    }

    /// The state and code a run ends with.
    type Want = (RunState, Option<ErrorCode>);

    #[test]
    fn an_executors_report_ends_the_run_as_the_table_says() {
        use automesh_proto::v1::RunState as Pb;
        use epb::ExecutionPhase::{Admitted, Finished, Running};
        let deadline = Some(CancelCause::Deadline);
        let user = Some(CancelCause::User);
        let budget = Some(CancelCause::Budget);
        #[rustfmt::skip]
        let table: &[(&str, epb::ExecutionStatus, Option<CancelCause>, Option<Want>)] = &[
            ("still running", status(Running, None), None, None),
            ("only admitted", status(Admitted, None), deadline, None),
            ("succeeded", status(Finished, Some(outcome(Pb::Succeeded, ""))), None, Some((RunState::Succeeded, None))),
            ("succeeded, code ignored", status(Finished, Some(outcome(Pb::Succeeded, "internal"))), None, Some((RunState::Succeeded, None))),
            ("failed with its code", status(Finished, Some(outcome(Pb::Failed, "provider_error"))), None, Some((RunState::Failed, Some(ErrorCode::ProviderError)))),
            ("failed without a code", status(Finished, Some(outcome(Pb::Failed, ""))), None, Some((RunState::Failed, Some(ErrorCode::Internal)))),
            ("failed, unknown code", status(Finished, Some(outcome(Pb::Failed, "no_such_code"))), None, Some((RunState::Failed, Some(ErrorCode::Internal)))),
            ("cancelled by the user", status(Finished, Some(outcome(Pb::Cancelled, ""))), user, Some((RunState::Cancelled, None))),
            ("cancelled at the deadline", status(Finished, Some(outcome(Pb::Cancelled, ""))), deadline, Some((RunState::TimedOut, Some(ErrorCode::DeadlineExceeded)))),
            ("cancelled over its budget", status(Finished, Some(outcome(Pb::Cancelled, ""))), budget, Some((RunState::Failed, Some(ErrorCode::BudgetExceeded)))),
            ("stopped by its engine's budget", status(Finished, Some(outcome(Pb::Failed, "budget_exceeded"))), None, Some((RunState::Failed, Some(ErrorCode::BudgetExceeded)))),
            ("timed out on the executor", status(Finished, Some(outcome(Pb::TimedOut, "idle_timeout"))), None, Some((RunState::TimedOut, Some(ErrorCode::DeadlineExceeded)))),
            ("a non-terminal outcome", status(Finished, Some(outcome(Pb::Running, ""))), None, Some((RunState::Failed, Some(ErrorCode::Internal)))),
            ("no outcome at all", status(Finished, None), None, Some((RunState::Failed, Some(ErrorCode::Internal)))),
        ];
        for (name, s, cancel, want) in table {
            let got = finished(Some(s), *cancel).map(|e| (e.state, e.code));
            assert_eq!(&got, want, "{name}");
        }
        assert!(finished(None, None).is_none(), "no status, no ending");
    }

    #[test]
    fn a_cancellations_ending_depends_on_its_cause_and_on_idle() {
        #[rustfmt::skip]
        let table = [
            (CancelCause::User, true, RunState::Cancelled, None),
            (CancelCause::User, false, RunState::Cancelled, Some(ErrorCode::CancelUnobserved)),
            (CancelCause::Deadline, true, RunState::TimedOut, Some(ErrorCode::DeadlineExceeded)),
            (CancelCause::Budget, true, RunState::Failed, Some(ErrorCode::BudgetExceeded)),
            (CancelCause::Budget, false, RunState::Failed, Some(ErrorCode::BudgetExceeded)),
            (CancelCause::Deadline, false, RunState::TimedOut, Some(ErrorCode::DeadlineExceeded)),
        ];
        for (cause, idle, state, code) in table {
            let e = cancelled(cause, idle);
            assert_eq!((e.state, e.code), (state, code), "{cause:?} idle={idle}");
            assert!(e.message.is_some_and(|m| !m.is_empty()));
        }
    }

    #[test]
    fn a_desktop_run_no_runner_ran_ends_offline_or_unresponsive_at_its_deadline() {
        let timed_out = || cancelled(CancelCause::Deadline, true);
        #[rustfmt::skip]
        let table = [
            // ran, unaccepted, placement, cause → code
            (false, false, Placement::Desktop, CancelCause::Deadline, Some(ErrorCode::RunnerOffline)),
            (false, true, Placement::Desktop, CancelCause::Deadline, Some(ErrorCode::RunnerUnresponsive)),
            (true, false, Placement::Desktop, CancelCause::Deadline, Some(ErrorCode::DeadlineExceeded)),
            (true, true, Placement::Desktop, CancelCause::Deadline, Some(ErrorCode::DeadlineExceeded)),
            (false, false, Placement::Cloud, CancelCause::Deadline, Some(ErrorCode::DeadlineExceeded)),
            (false, true, Placement::Desktop, CancelCause::User, None),
        ];
        for (ran, unaccepted, placement, cause, code) in table {
            let ending = if cause == CancelCause::User {
                cancelled(cause, true)
            } else {
                timed_out()
            };
            let e = offline_unless(ran, unaccepted, placement, cause, ending);
            assert_eq!(
                e.code, code,
                "ran={ran} unaccepted={unaccepted} {placement:?} {cause:?}"
            );
        }
    }

    #[test]
    fn only_running_or_finished_means_the_executor_ran_it() {
        use epb::ExecutionPhase::*;
        for (phase, ran) in [
            (Unspecified, false),
            (Unknown, false),
            (Admitted, false),
            (Running, true),
            (Finished, true),
        ] {
            assert_eq!(
                ran_on_executor(Some(&status(phase, None))),
                ran,
                "{phase:?}"
            );
        }
        assert!(!ran_on_executor(None));
    }
}
