//! Reading one runner's stream: its messages, in order, until it leaves,
//! falls silent or is replaced — heartbeats answered at once, reports stored
//! one at a time and answered (a confirmation, a refusal), and the runner's
//! liveness judged by what it sends, never by how fast its reports are
//! stored.

use std::pin::Pin;
use std::sync::atomic::Ordering;

use automesh_edge::status;
use automesh_proto::runner::v1 as rpb;
use automesh_store::Store;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use tonic::{Status, Streaming};

use crate::dispatch::Dispatch;
use crate::outbound::send;
use crate::reports::{Answer, record};
use crate::stream::{LOST_GRACE, Session, StreamSettings, heard_now};

/// How many of a runner's reports may wait while one is stored, before the
/// gateway stops reading the runner's stream (HTTP/2 flow control then
/// holds the runner back). Each is at most one message (4 MiB).
const REPORTS_WAITING: usize = 2;

/// One report being stored, bounded by the report timeout.
type Recording<'a> = Pin<
    Box<
        dyn std::future::Future<
                Output = Result<
                    Result<Answer, automesh_store::StoreError>,
                    tokio::time::error::Elapsed,
                >,
            > + Send
            + 'a,
    >,
>;

/// Reads the runner's messages until it leaves, falls silent, or is
/// replaced.
///
/// A runner's liveness is judged by what it sends, never by how fast the
/// gateway stores it: reading goes on while a report is stored — a
/// heartbeat is answered at once, reports wait their turn in order — until
/// [`REPORTS_WAITING`] reports wait; then the gateway stops reading (flow
/// control back-pressures the runner), tells the runner it lives with an
/// unsolicited `HeartbeatAck` every heartbeat interval, and does not count
/// the runner's silence until it reads again. A runner that truly stops
/// sending is declared dead after `dead_after` of silence while the gateway
/// reads.
pub(crate) async fn follow(
    inbound: &mut Streaming<rpb::ConnectRequest>,
    session: &Session,
    settings: &StreamSettings,
    shutdown: &CancellationToken,
    store: &Store,
    dispatch: &Dispatch,
) -> Result<(), Status> {
    use rpb::connect_request::Message;
    let tx = &session.tx;
    // A PING-liveness stream has no silence bound of its own: the
    // connection's keepalive closes it when it stops answering.
    let silence = (!session.ping_liveness).then_some(settings.dead_after);
    let record_bounded = |report: Message| -> Recording<'_> {
        Box::pin(tokio::time::timeout(
            settings.report_timeout,
            record(store, session, report),
        ))
    };
    let mut recording: Option<Recording<'_>> = None;
    let mut waiting: std::collections::VecDeque<Message> = Default::default();
    // The runner's stream ended (how), with reports still to store.
    let mut ended: Option<Result<(), Status>> = None;
    // Since when the gateway has been reading without hearing the runner.
    let mut quiet_since = tokio::time::Instant::now();
    let mut was_reading = true;
    let mut busy = tokio::time::interval(settings.heartbeat_interval);
    busy.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        if let Some(end) = ended.take() {
            if recording.is_none() {
                return end;
            }
            ended = Some(end);
        }
        let reading = ended.is_none() && waiting.len() < REPORTS_WAITING;
        if reading && !was_reading {
            // Listening again: silence counts from now, not from while the
            // gateway held the runner back.
            quiet_since = tokio::time::Instant::now();
        }
        if !reading && was_reading {
            busy.reset();
        }
        was_reading = reading;
        let silent_at = silence.map(|bound| quiet_since + bound);
        tokio::select! {
            () = session.closed.cancelled() => return Err(Status::aborted("replaced by a newer stream of this runner")),
            () = session.revoked.cancelled() => return Err(Status::unauthenticated("the runner was revoked")),
            () = shutdown.cancelled() => return Err(status::shutting_down("reconnect")),
            stored = async { recording.as_mut().expect("guarded").await }, if recording.is_some() => {
                recording = waiting.pop_front().map(record_bounded);
                match stored {
                    Ok(Ok(Answer::Nothing)) => {}
                    Ok(Ok(Answer::Confirmed(run_id))) => {
                        dispatch.accepted(&run_id);
                        let confirmed = rpb::ConnectResponse {
                            message: Some(rpb::connect_response::Message::AssignmentConfirmed(
                                rpb::AssignmentConfirmed { run_id },
                            )),
                        };
                        if !send(tx, confirmed).await {
                            return Ok(());
                        }
                    }
                    Ok(Ok(Answer::Refused(refusal))) => {
                        let span = automesh_telemetry::propagation::run_span(
                            "automesh.desktop.refused",
                            &refusal.run_id,
                            refusal.traceparent.as_deref(),
                        );
                        tracing::warn!(
                            parent: &span,
                            runner_id = %session.runner_id,
                            run_id = %refusal.run_id,
                            code = refusal.code,
                            "a runner's report was refused"
                        );
                        crate::metrics::protocol_error(refusal.code);
                        if !send(tx, refusal.message()).await {
                            return Ok(());
                        }
                    }
                    // A report that cannot be recorded ends the stream; the
                    // runner resends what it holds when it reconnects
                    // (event ids make that harmless).
                    Ok(Err(error)) => {
                        return Err(status::of(&error, "recording the runner's report"));
                    }
                    Err(_) => {
                        return Err(status::unavailable(
                            "recording the runner's report",
                            &format!("not stored within {:?}; reconnect", settings.report_timeout),
                        ));
                    }
                }
            }
            _ = busy.tick(), if !reading && ended.is_none() => {
                // Held back by the gateway, not silent: say so, so that a
                // runner judging the gateway by its acks does not leave.
                let alive = rpb::ConnectResponse {
                    message: Some(rpb::connect_response::Message::HeartbeatAck(
                        rpb::HeartbeatAck { send_time: None },
                    )),
                };
                let _ = tx.try_send(Ok(Box::new(alive)));
            }
            () = sleep_until_some(silent_at), if reading => {
                return Err(Status::deadline_exceeded(format!(
                    "no heartbeat for {:?}: the stream is declared dead",
                    settings.dead_after
                )));
            }
            next = inbound.next(), if reading => {
                let message = match next {
                    // The runner ended its stream; or its connection went (a
                    // PING-liveness connection that stopped answering is
                    // closed by the keepalive), which drops the way back too,
                    // a moment later. What it sent before is stored first.
                    None => {
                        ended = Some(match tokio::time::timeout(LOST_GRACE, tx.closed()).await {
                            Ok(()) => Err(status::connection_lost(
                                "the runner's stream is declared dead",
                            )),
                            Err(_) => Ok(()),
                        });
                        continue;
                    }
                    // A runner message over the size limit is
                    // RESOURCE_EXHAUSTED, as for every request (see the
                    // server builder).
                    Some(Err(status))
                        if status.code() == tonic::Code::OutOfRange
                            && status.message().contains("message length too large") =>
                    {
                        return Err(Status::resource_exhausted(status.message().to_owned()));
                    }
                    Some(Err(status)) => return Err(status),
                    Some(Ok(m)) => m,
                };
                quiet_since = tokio::time::Instant::now();
                session.last_heard.store(heard_now(), Ordering::Relaxed);
                match message.message {
                    Some(Message::Heartbeat(h)) => {
                        let ack = rpb::ConnectResponse {
                            message: Some(rpb::connect_response::Message::HeartbeatAck(
                                rpb::HeartbeatAck {
                                    send_time: h.send_time,
                                },
                            )),
                        };
                        // A runner that does not read its acks for a whole
                        // dead period is as dead as one that does not write.
                        match tokio::time::timeout(settings.dead_after, tx.send(Ok(Box::new(ack)))).await {
                            Ok(Ok(())) => {}
                            Ok(Err(_)) => return Ok(()),
                            Err(_) => {
                                return Err(Status::resource_exhausted(
                                    "the runner stopped reading its stream",
                                ));
                            }
                        }
                    }
                    Some(Message::Hello(_)) => {
                        return Err(Status::failed_precondition(
                            "Hello may be sent only once per stream",
                        ));
                    }
                    // Reports are stored one at a time, in the order sent.
                    Some(report) => match recording {
                        None => recording = Some(record_bounded(report)),
                        Some(_) => waiting.push_back(report),
                    },
                    None => {}
                }
            }
        }
    }
}

/// Sleeps until `at`, or forever without one.
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
