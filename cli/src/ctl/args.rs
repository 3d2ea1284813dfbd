//! What `ctl` parses from its command line: its commands and their flags,
//! schedules, weekdays, run states, instants and budget caps.

use anyhow::Context;
use automesh_edge::convert;
use automesh_proto::v1 as pb;
use chrono::{DateTime, Utc};

use clap::{Args, Subcommand, ValueEnum};

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(super) enum SurfaceArg {
    Desktop,
    Web,
    CloudChat,
}

/// A schedule given on the command line.
#[derive(Debug, Args, Default)]
pub(super) struct ScheduleArgs {
    /// Fire once at an RFC 3339 instant, such as 2026-12-24T09:00:00Z.
    #[arg(long, conflicts_with_all = ["daily", "weekly"])]
    once: Option<String>,
    /// Fire every day at HH:MM local time.
    #[arg(long, conflicts_with = "weekly")]
    daily: Option<String>,
    /// Fire on these weekdays (mon,tue,…) at --at local time.
    #[arg(long, value_delimiter = ',')]
    weekly: Option<Vec<String>>,
    /// Time of day for --weekly, HH:MM.
    #[arg(long)]
    at: Option<String>,
    /// IANA time zone of --daily / --weekly.
    #[arg(long, default_value = "UTC")]
    tz: String,
}

/// A budget cap given on the command line: a number, or `none` (no cap).
#[derive(Debug, Clone, Copy)]
pub(super) struct Cap(pub(super) Option<i64>);

fn parse_cap(s: &str) -> Result<Cap, String> {
    if s.eq_ignore_ascii_case("none") {
        return Ok(Cap(None));
    }
    s.parse()
        .map(|n| Cap(Some(n)))
        .map_err(|_| format!("{s:?} is neither a whole number nor \"none\""))
}

#[derive(Debug, Subcommand)]
pub(super) enum CtlCommand {
    /// Create an automation.
    Create {
        #[arg(long)]
        name: String,
        #[arg(long)]
        prompt: String,
        #[arg(long, default_value = "openai/gpt-4.1-mini")]
        model: String,
        /// The creating surface, which decides placement (desktop → desktop; web, cloud-chat → cloud).
        #[arg(long, value_enum, default_value = "desktop")]
        surface: SurfaceArg,
        #[command(flatten)]
        schedule: ScheduleArgs,
        /// Pause the automation (needs attention, `failing_repeatedly`) after
        /// this many runs in a row end failed or timed out; 0 never pauses.
        /// 3 unless given.
        #[arg(long, value_name = "RUNS")]
        pause_after_failures: Option<i32>,
        /// The most one run may cost, in micro-units of the catalogue's
        /// currency; a run over it stops at that step (budget_exceeded).
        #[arg(long, value_name = "MICROS")]
        max_cost_micros: Option<i64>,
        /// The most input and output tokens together one run may use.
        #[arg(long, value_name = "TOKENS")]
        max_tokens: Option<i64>,
        /// The most its runs created in a calendar month (of the schedule's
        /// zone) may cost together, in micro-units; once spent, occurrences
        /// and run-now are skipped (budget_exhausted) until the month ends.
        #[arg(long, value_name = "MICROS")]
        monthly_budget_micros: Option<i64>,
    },
    /// List your automations.
    List {
        /// Include archived automations.
        #[arg(long)]
        all: bool,
    },
    /// Show one automation.
    Get { id: String },
    /// Change name, prompt, model, schedule or the failure streak that
    /// pauses it (placement never changes).
    Update {
        id: String,
        #[arg(long)]
        name: Option<String>,
        #[arg(long)]
        prompt: Option<String>,
        #[arg(long)]
        model: Option<String>,
        #[command(flatten)]
        schedule: ScheduleArgs,
        /// Pause it after this many runs in a row end failed or timed out;
        /// 0 never pauses.
        #[arg(long, value_name = "RUNS")]
        pause_after_failures: Option<i32>,
        /// The most one run may cost, in micro-units ("none" removes the cap).
        #[arg(long, value_name = "MICROS|none", value_parser = parse_cap)]
        max_cost_micros: Option<Cap>,
        /// The most tokens one run may use ("none" removes the cap).
        #[arg(long, value_name = "TOKENS|none", value_parser = parse_cap)]
        max_tokens: Option<Cap>,
        /// The monthly budget in micro-units ("none" removes it); raised
        /// above the month's spend, a paused automation is active again.
        #[arg(long, value_name = "MICROS|none", value_parser = parse_cap)]
        monthly_budget_micros: Option<Cap>,
        /// Only update if the automation is still at this etag.
        #[arg(long)]
        etag: Option<String>,
    },
    /// Resume scheduling (also clears needs-attention). Several ids are
    /// resumed in one batch call, each with its own answer.
    Activate {
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Pause scheduling. Several ids are paused in one batch call, each with
    /// its own answer.
    Deactivate {
        #[arg(required = true)]
        ids: Vec<String>,
        /// Why (shown with the automation until it is activated again).
        #[arg(long)]
        reason: Option<String>,
    },
    /// Archive: keep history, no more occurrences.
    Archive { id: String },
    /// Start a manual run.
    RunNow {
        id: String,
        /// Idempotency key; the same key returns the same run (default: random).
        #[arg(long)]
        key: Option<String>,
    },
    /// List runs, newest first.
    Runs {
        /// Only runs of this automation.
        #[arg(long)]
        automation: Option<String>,
        #[arg(long, default_value_t = 20)]
        limit: i32,
        /// Only runs in this state (repeatable): pending, waking, admitted,
        /// running, succeeded, failed, timed_out, cancelled, skipped, missed.
        #[arg(long = "state", value_parser = parse_run_state)]
        states: Vec<i32>,
        /// Only runs created at or after this instant (RFC 3339).
        #[arg(long, value_parser = parse_instant)]
        since: Option<prost_types::Timestamp>,
        /// Only runs that carry this error code (repeatable), such as
        /// missed_during_downtime or previous_run_live: the occurrences that
        /// did not run, and why (docs/error-codes.md).
        #[arg(long = "reason", value_name = "CODE")]
        reasons: Vec<String>,
        /// Only runs created before this instant (RFC 3339).
        #[arg(long, value_parser = parse_instant)]
        until: Option<prost_types::Timestamp>,
    },
    /// Show one run and its receipt.
    Run { id: String },
    /// Cancel a run.
    Cancel { id: String },
    /// Print a run's events after a sequence number.
    Events {
        id: String,
        #[arg(long, default_value_t = 0)]
        after: i64,
    },
    /// Follow a run's events live until it ends.
    Watch {
        id: String,
        #[arg(long, default_value_t = 0)]
        after: i64,
    },
    /// Mint a desktop runner token (shown once).
    RunnerToken {
        #[arg(long)]
        name: String,
    },
    /// List your desktop runners: connected or not, and when last seen.
    Runners,
    /// Sum the usage of your runs (or one automation's) over a period, per
    /// day of a zone.
    Usage {
        /// Only this automation's runs.
        #[arg(long)]
        automation: Option<String>,
        /// Runs created at or after this instant (RFC 3339; default: 30 days ago).
        #[arg(long, value_parser = parse_instant)]
        since: Option<prost_types::Timestamp>,
        /// Runs created before this instant (RFC 3339; default: now).
        #[arg(long, value_parser = parse_instant)]
        until: Option<prost_types::Timestamp>,
        /// The IANA zone whose days are shown (default: UTC).
        #[arg(long, default_value = "")]
        tz: String,
    },
    /// Webhook endpoints: where you are told of failed runs, automations
    /// that need attention, spent budgets and missed occurrences.
    #[command(subcommand)]
    Webhooks(super::webhooks::WebhooksCommand),
    /// Revoke a desktop runner: its token stops working and its stream ends.
    RevokeRunner {
        /// The runner id `runner-token` printed.
        runner_id: String,
    },
    /// Mint a development token for another user (dev mode: signs with <data-dir>/jwt-secret).
    Token {
        #[arg(long)]
        user: String,
        #[arg(long)]
        org: String,
        /// Validity in hours.
        #[arg(long, default_value_t = 24 * 30)]
        hours: i64,
    },
}

fn parse_time_of_day(s: &str) -> anyhow::Result<pb::TimeOfDay> {
    let (h, m) = s
        .split_once(':')
        .with_context(|| format!("expected HH:MM, got {s:?}"))?;
    Ok(pb::TimeOfDay {
        hours: h.parse().with_context(|| format!("bad hour in {s:?}"))?,
        minutes: m.parse().with_context(|| format!("bad minute in {s:?}"))?,
    })
}

fn parse_day(d: &str) -> anyhow::Result<i32> {
    let day = match d.trim().to_ascii_lowercase().get(..3) {
        Some("mon") => pb::DayOfWeek::Monday,
        Some("tue") => pb::DayOfWeek::Tuesday,
        Some("wed") => pb::DayOfWeek::Wednesday,
        Some("thu") => pb::DayOfWeek::Thursday,
        Some("fri") => pb::DayOfWeek::Friday,
        Some("sat") => pb::DayOfWeek::Saturday,
        Some("sun") => pb::DayOfWeek::Sunday,
        _ => anyhow::bail!("unknown weekday {d:?}; use mon, tue, wed, thu, fri, sat, sun"),
    };
    Ok(day as i32)
}

impl ScheduleArgs {
    pub(super) fn to_pb(&self) -> anyhow::Result<Option<pb::Schedule>> {
        use pb::schedule::Kind;
        let kind = if let Some(at) = &self.once {
            let at: DateTime<Utc> = DateTime::parse_from_rfc3339(at)
                .with_context(|| format!("--once wants an RFC 3339 instant, got {at:?}"))?
                .with_timezone(&Utc);
            Kind::Once(pb::OnceSchedule {
                at: Some(convert::timestamp(at)),
            })
        } else if let Some(t) = &self.daily {
            Kind::Daily(pb::DailySchedule {
                time_of_day: Some(parse_time_of_day(t)?),
                time_zone: self.tz.clone(),
            })
        } else if let Some(days) = &self.weekly {
            let at = self.at.as_deref().context("--weekly needs --at HH:MM")?;
            Kind::Weekly(pb::WeeklySchedule {
                days: days
                    .iter()
                    .map(|d| parse_day(d))
                    .collect::<anyhow::Result<_>>()?,
                time_of_day: Some(parse_time_of_day(at)?),
                time_zone: self.tz.clone(),
            })
        } else {
            return Ok(None);
        };
        Ok(Some(pb::Schedule { kind: Some(kind) }))
    }
}

/// A run state as `ctl` takes it (`timed_out`, `missed`, …).
pub(super) fn parse_run_state(s: &str) -> Result<i32, String> {
    let name = format!("RUN_STATE_{}", s.trim().to_ascii_uppercase());
    pb::RunState::from_str_name(&name)
        .filter(|v| *v != pb::RunState::Unspecified)
        .map(|v| v as i32)
        .ok_or_else(|| {
            format!(
                "unknown run state {s:?}; one of pending, waking, admitted, running, succeeded, \
                 failed, timed_out, cancelled, skipped, missed"
            )
        })
}

/// An RFC 3339 instant (`2026-12-01T00:00:00Z`).
pub(super) fn parse_instant(s: &str) -> Result<prost_types::Timestamp, String> {
    chrono::DateTime::parse_from_rfc3339(s.trim())
        .map(|t| automesh_edge::convert::timestamp(t.with_timezone(&chrono::Utc)))
        .map_err(|e| format!("expected an RFC 3339 instant such as 2026-12-01T00:00:00Z: {e}"))
}
