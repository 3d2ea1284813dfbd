//! What `ctl` parses from its command line: schedules, weekdays, run
//! states and instants.

use anyhow::Context;
use automesh_edge::convert;
use automesh_proto::v1 as pb;
use chrono::{DateTime, Utc};

use super::ScheduleArgs;

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
