//! Schedules, validated as they are converted.

use automesh_domain::schedule::parse_time_zone;
use automesh_domain::{Schedule, TimeOfDay, Violations, WeekdaySet};
use automesh_proto::v1 as pb;
use chrono::{DateTime, Utc, Weekday};

#[allow(unused_imports)]
use super::*;

fn time_of_day(t: Option<&pb::TimeOfDay>, field: &str, v: &mut Violations) -> Option<TimeOfDay> {
    let Some(t) = t else {
        v.field(field, "required");
        return None;
    };
    let parsed = u32::try_from(t.hours)
        .ok()
        .zip(u32::try_from(t.minutes).ok())
        .and_then(|(h, m)| TimeOfDay::new(h, m));
    if parsed.is_none() {
        v.field(field, "hours must be 0..=23 and minutes 0..=59");
    }
    parsed
}

fn time_zone(name: &str, field: &str, v: &mut Violations) -> Option<chrono_tz::Tz> {
    let zone = parse_time_zone(name);
    if zone.is_none() {
        if name.is_empty() {
            v.field(field, "required (an IANA time zone such as Europe/Paris)");
        } else {
            v.field(field, format!("unknown time zone {name:?}"));
        }
    }
    zone
}

/// Parses a schedule; `field` is its request path (such as
/// `automation.schedule`). A `once` instant must be after `now`.
pub fn schedule_from_pb(
    s: Option<&pb::Schedule>,
    field: &str,
    now: DateTime<Utc>,
    v: &mut Violations,
) -> Option<Schedule> {
    use pb::schedule::Kind;
    let Some(kind) = s.and_then(|s| s.kind.as_ref()) else {
        v.field(field, "required: one of once, daily, weekly");
        return None;
    };
    let before = v.iter().count();
    let schedule = match kind {
        Kind::Once(o) => match o.at.as_ref() {
            None => {
                v.field(format!("{field}.once.at"), "required");
                None
            }
            Some(ts) => match from_timestamp(ts) {
                Some(at) => Some(Schedule::Once { at }),
                None => {
                    v.field(
                        format!("{field}.once.at"),
                        "not a valid timestamp: it must lie between \
                         0001-01-01T00:00:00Z and 9999-12-31T23:59:59Z",
                    );
                    None
                }
            },
        },
        Kind::Daily(d) => {
            let time = time_of_day(
                d.time_of_day.as_ref(),
                &format!("{field}.daily.time_of_day"),
                v,
            );
            let zone = time_zone(&d.time_zone, &format!("{field}.daily.time_zone"), v);
            time.zip(zone)
                .map(|(time, zone)| Schedule::Daily { time, zone })
        }
        Kind::Weekly(w) => {
            let days_field = format!("{field}.weekly.days");
            let days: Vec<Option<Weekday>> = w.days.iter().map(|d| weekday_from_pb(*d)).collect();
            let set = if days.is_empty() {
                v.field(&days_field, "at least one day is required");
                None
            } else if days.iter().any(Option::is_none) {
                v.field(&days_field, "every day must be MONDAY..SUNDAY");
                None
            } else {
                WeekdaySet::new(days.into_iter().flatten())
            };
            let time = time_of_day(
                w.time_of_day.as_ref(),
                &format!("{field}.weekly.time_of_day"),
                v,
            );
            let zone = time_zone(&w.time_zone, &format!("{field}.weekly.time_zone"), v);
            match (set, time, zone) {
                (Some(days), Some(time), Some(zone)) => Some(Schedule::Weekly { days, time, zone }),
                _ => None,
            }
        }
    };
    if let Some(s) = &schedule {
        s.check_for_write(now, field, v);
    }
    if v.iter().count() > before {
        None
    } else {
        schedule
    }
}

pub fn schedule_to_pb(s: &Schedule) -> pb::Schedule {
    use pb::schedule::Kind;
    let tod = |t: &TimeOfDay| pb::TimeOfDay {
        hours: t.hour() as i32,
        minutes: t.minute() as i32,
    };
    pb::Schedule {
        kind: Some(match s {
            Schedule::Once { at } => Kind::Once(pb::OnceSchedule {
                at: Some(timestamp(*at)),
            }),
            Schedule::Daily { time, zone } => Kind::Daily(pb::DailySchedule {
                time_of_day: Some(tod(time)),
                time_zone: zone.name().to_owned(),
            }),
            Schedule::Weekly { days, time, zone } => Kind::Weekly(pb::WeeklySchedule {
                days: days
                    .days()
                    .into_iter()
                    .map(|d| weekday_to_pb(d) as i32)
                    .collect(),
                time_of_day: Some(tod(time)),
                time_zone: zone.name().to_owned(),
            }),
        }),
    }
}
