//! Schedules (`once`, `daily`, `weekly`) in IANA time zones, and the instant
//! each occurrence falls due.
//!
//! The DST rules are the product's (SPEC §3): a local time that does not exist
//! (spring forward) fires at the first valid instant after it, which is the
//! transition itself; a local time that exists twice (fall back) fires once,
//! at the first of the two instants.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Datelike, Duration, NaiveDate, NaiveDateTime, NaiveTime, TimeZone, Utc};
use chrono::{LocalResult, Weekday};
use chrono_tz::Tz;
use serde::{Deserialize, Serialize};

use crate::validation::{FieldViolation, Violations};

/// A wall-clock time of day, to the minute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TimeOfDay {
    hour: u8,
    minute: u8,
}

impl TimeOfDay {
    /// `None` unless `hour < 24` and `minute < 60`.
    pub fn new(hour: u32, minute: u32) -> Option<Self> {
        (hour < 24 && minute < 60).then_some(Self {
            hour: hour as u8,
            minute: minute as u8,
        })
    }

    pub fn hour(self) -> u32 {
        u32::from(self.hour)
    }

    pub fn minute(self) -> u32 {
        u32::from(self.minute)
    }

    fn naive(self) -> NaiveTime {
        NaiveTime::from_hms_opt(self.hour(), self.minute(), 0).unwrap_or(NaiveTime::MIN)
    }
}

impl fmt::Display for TimeOfDay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:02}:{:02}", self.hour, self.minute)
    }
}

impl FromStr for TimeOfDay {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (h, m) = s
            .split_once(':')
            .ok_or_else(|| format!("expected HH:MM, got {s:?}"))?;
        let h: u32 = h.parse().map_err(|_| format!("bad hour in {s:?}"))?;
        let m: u32 = m.parse().map_err(|_| format!("bad minute in {s:?}"))?;
        TimeOfDay::new(h, m).ok_or_else(|| format!("time of day out of range: {s:?}"))
    }
}

/// A non-empty set of weekdays, as a bit mask (Monday is bit 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WeekdaySet(u8);

impl WeekdaySet {
    /// `None` when `days` is empty.
    pub fn new(days: impl IntoIterator<Item = Weekday>) -> Option<Self> {
        let mask = days
            .into_iter()
            .fold(0u8, |m, d| m | (1 << d.num_days_from_monday()));
        (mask != 0).then_some(Self(mask))
    }

    pub fn contains(self, day: Weekday) -> bool {
        self.0 & (1 << day.num_days_from_monday()) != 0
    }

    /// The days in ISO order (Monday first).
    pub fn days(self) -> Vec<Weekday> {
        (0..7)
            .filter(|i| self.0 & (1 << i) != 0)
            .filter_map(|i| Weekday::try_from(i as u8).ok())
            .collect()
    }
}

/// When an automation's occurrences fall due.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Schedule {
    Once {
        at: DateTime<Utc>,
    },
    Daily {
        time: TimeOfDay,
        zone: Tz,
    },
    Weekly {
        days: WeekdaySet,
        time: TimeOfDay,
        zone: Tz,
    },
}

impl Schedule {
    /// The first occurrence strictly after `after`, or `None` when there is
    /// none (a `once` schedule in the past).
    pub fn next_after(&self, after: DateTime<Utc>) -> Option<DateTime<Utc>> {
        match *self {
            Schedule::Once { at } => (at > after).then_some(at),
            Schedule::Daily { time, zone } => first_slot_after(zone, time, after, |_| true),
            Schedule::Weekly { days, time, zone } => {
                first_slot_after(zone, time, after, |d| days.contains(d.weekday()))
            }
        }
    }

    /// A short kind name, for logs and storage.
    pub fn kind(&self) -> &'static str {
        match self {
            Schedule::Once { .. } => "once",
            Schedule::Daily { .. } => "daily",
            Schedule::Weekly { .. } => "weekly",
        }
    }

    /// Validates a schedule for an automation being created or edited at
    /// `now`: a `once` instant must be in the future, and no later than the
    /// last instant a protobuf Timestamp holds (9999-12-31T23:59:59Z).
    pub fn check_for_write(&self, now: DateTime<Utc>, field: &str, v: &mut Violations) {
        if let Schedule::Once { at } = self {
            if *at <= now {
                v.push(FieldViolation::new(
                    format!("{field}.once.at"),
                    "must be in the future",
                ));
            } else if at.timestamp() > LATEST_INSTANT_SECONDS {
                v.push(FieldViolation::new(
                    format!("{field}.once.at"),
                    "must be no later than 9999-12-31T23:59:59Z",
                ));
            }
        }
    }
}

impl Schedule {
    /// The zone the schedule's wall-clock times are in (UTC for `once`).
    pub fn zone(&self) -> Tz {
        match *self {
            Schedule::Once { .. } => Tz::UTC,
            Schedule::Daily { zone, .. } | Schedule::Weekly { zone, .. } => zone,
        }
    }

    /// Up to `count` occurrences after `after`, in order.
    pub fn occurrences(&self, after: DateTime<Utc>, count: usize) -> Vec<DateTime<Utc>> {
        let mut out = Vec::with_capacity(count);
        let mut at = after;
        while out.len() < count {
            match self.next_after(at) {
                Some(next) => {
                    out.push(next);
                    at = next;
                }
                None => break,
            }
        }
        out
    }
}

/// The first instant after `after`, within `within`, at which `zone`'s
/// offset from UTC changes (a DST transition), to the second.
pub fn next_offset_change(
    zone: Tz,
    after: DateTime<Utc>,
    within: Duration,
) -> Option<DateTime<Utc>> {
    use chrono::Offset;
    let offset = |t: DateTime<Utc>| t.with_timezone(&zone).offset().fix().local_minus_utc();
    let first = offset(after);
    // Offsets hold for weeks at least: look a day at a time, then bisect
    // the day that changed it down to the second.
    let mut lo = after;
    let end = after + within;
    while lo < end {
        let hi = (lo + Duration::days(1)).min(end);
        if offset(hi) != first {
            let (mut a, mut b) = (lo.timestamp(), hi.timestamp());
            while b - a > 1 {
                let mid = a + (b - a) / 2;
                let at = DateTime::from_timestamp(mid, 0)?;
                if offset(at) == first {
                    a = mid;
                } else {
                    b = mid;
                }
            }
            return DateTime::from_timestamp(b, 0);
        }
        lo = hi;
    }
    None
}

/// 9999-12-31T23:59:59Z, the last second a protobuf Timestamp holds.
pub const LATEST_INSTANT_SECONDS: i64 = 253_402_300_799;

/// The instant at which the slot of local `date` at `time` in `zone` fires.
pub fn slot_instant(zone: Tz, date: NaiveDate, time: TimeOfDay) -> DateTime<Utc> {
    let local = date.and_time(time.naive());
    match zone.from_local_datetime(&local) {
        LocalResult::Single(t) => t.with_timezone(&Utc),
        // Fall back: the wall-clock time happens twice; fire at the first.
        LocalResult::Ambiguous(a, b) => a.min(b).with_timezone(&Utc),
        // Spring forward: the wall-clock time does not exist.
        LocalResult::None => first_instant_at_or_after(zone, local),
    }
}

/// The least instant whose local time in `zone` is at or after `local`. Used
/// for a local time inside a gap, where the answer is the transition instant.
fn first_instant_at_or_after(zone: Tz, local: NaiveDateTime) -> DateTime<Utc> {
    // Every UTC offset lies within ±15 h, so the transition is inside this
    // window, and local time is monotonic across it (no zone has two
    // transitions within a day of each other).
    let base = local.and_utc().timestamp();
    let (mut lo, mut hi) = (base - 15 * 3600, base + 15 * 3600);
    let local_of = |secs: i64| {
        DateTime::from_timestamp(secs, 0)
            .map(|t| t.with_timezone(&zone).naive_local())
            .unwrap_or(NaiveDateTime::MIN)
    };
    // Invariant: local_of(lo) < local <= local_of(hi). Transitions fall on
    // whole seconds, so `hi` ends as the transition instant.
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if local_of(mid) >= local {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    DateTime::from_timestamp(hi, 0).unwrap_or(DateTime::<Utc>::MIN_UTC)
}

fn first_slot_after(
    zone: Tz,
    time: TimeOfDay,
    after: DateTime<Utc>,
    wanted: impl Fn(NaiveDate) -> bool,
) -> Option<DateTime<Utc>> {
    // Start two days before the local date of `after`: a slot in a skipped
    // day can resolve into the next day, so earlier dates may still be later.
    let start = after.with_timezone(&zone).date_naive() - Duration::days(2);
    (0..16)
        .map(|i| start + Duration::days(i))
        .filter(|d| wanted(*d))
        .map(|d| slot_instant(zone, d, time))
        .find(|t| *t > after)
}

/// Parses an IANA zone name; `None` for anything tzdb does not know.
pub fn parse_time_zone(name: &str) -> Option<Tz> {
    if name.is_empty() {
        return None;
    }
    Tz::from_str(name).ok()
}

/// The stored form of a schedule (JSON in the `schedule` column).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ScheduleRecord {
    Once {
        /// Microseconds since the Unix epoch.
        at_micros: i64,
    },
    Daily {
        time: String,
        time_zone: String,
    },
    Weekly {
        /// ISO weekday numbers, Monday = 1.
        days: Vec<u8>,
        time: String,
        time_zone: String,
    },
}

impl From<&Schedule> for ScheduleRecord {
    fn from(s: &Schedule) -> Self {
        match s {
            Schedule::Once { at } => ScheduleRecord::Once {
                at_micros: at.timestamp_micros(),
            },
            Schedule::Daily { time, zone } => ScheduleRecord::Daily {
                time: time.to_string(),
                time_zone: zone.name().to_owned(),
            },
            Schedule::Weekly { days, time, zone } => ScheduleRecord::Weekly {
                days: days
                    .days()
                    .into_iter()
                    .map(|d| d.number_from_monday() as u8)
                    .collect(),
                time: time.to_string(),
                time_zone: zone.name().to_owned(),
            },
        }
    }
}

impl TryFrom<ScheduleRecord> for Schedule {
    type Error = String;

    fn try_from(r: ScheduleRecord) -> Result<Self, Self::Error> {
        let zone = |name: &str| parse_time_zone(name).ok_or_else(|| format!("unknown zone {name}"));
        Ok(match r {
            ScheduleRecord::Once { at_micros } => Schedule::Once {
                at: DateTime::from_timestamp_micros(at_micros)
                    .ok_or_else(|| "instant out of range".to_owned())?,
            },
            ScheduleRecord::Daily { time, time_zone } => Schedule::Daily {
                time: time.parse()?,
                zone: zone(&time_zone)?,
            },
            ScheduleRecord::Weekly {
                days,
                time,
                time_zone,
            } => Schedule::Weekly {
                days: WeekdaySet::new(
                    days.iter()
                        .filter_map(|d| d.checked_sub(1))
                        .filter_map(|d| Weekday::try_from(d).ok()),
                )
                .ok_or_else(|| "weekly schedule without days".to_owned())?,
                time: time.parse()?,
                zone: zone(&time_zone)?,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn utc(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s)
            .expect("test instant")
            .with_timezone(&Utc)
    }

    fn daily(h: u32, m: u32, zone: Tz) -> Schedule {
        Schedule::Daily {
            time: TimeOfDay::new(h, m).expect("time"),
            zone,
        }
    }

    /// Every occurrence in `[from, to)`.
    fn occurrences(s: &Schedule, from: DateTime<Utc>, to: DateTime<Utc>) -> Vec<DateTime<Utc>> {
        let mut out = vec![];
        let mut t = from;
        while let Some(n) = s.next_after(t) {
            if n >= to {
                break;
            }
            out.push(n);
            t = n;
        }
        out
    }

    #[test]
    fn new_york_spring_forward_fires_once_at_three() {
        // 2026-03-08: 02:00 EST jumps to 03:00 EDT; 02:30 does not exist.
        let s = daily(2, 30, chrono_tz::America::New_York);
        let got = occurrences(&s, utc("2026-03-07T12:00:00Z"), utc("2026-03-09T12:00:00Z"));
        // 03:00 EDT is 07:00Z, the transition instant; the next day is normal.
        assert_eq!(
            got,
            vec![
                utc("2026-03-08T07:00:00Z"),
                utc("2026-03-09T02:30:00-04:00")
            ]
        );
    }

    #[test]
    fn new_york_fall_back_fires_once_at_the_first() {
        // 2026-11-01: 02:00 EDT falls back to 01:00 EST; 01:30 happens twice.
        let s = daily(1, 30, chrono_tz::America::New_York);
        let got = occurrences(&s, utc("2026-11-01T00:00:00Z"), utc("2026-11-02T00:00:00Z"));
        assert_eq!(got, vec![utc("2026-11-01T01:30:00-04:00")]);
    }

    #[test]
    fn lord_howe_half_hour_shift() {
        // 2026-10-04 02:00 LHST (+10:30) jumps to 02:30 LHDT (+11:00).
        let s = daily(2, 15, chrono_tz::Australia::Lord_Howe);
        let got = occurrences(&s, utc("2026-10-03T00:00:00Z"), utc("2026-10-04T12:00:00Z"));
        assert_eq!(got, vec![utc("2026-10-04T02:30:00+11:00")]);
        // 2026-04-05 02:00 LHDT falls back to 01:30 LHST: 01:45 exists twice.
        let s = daily(1, 45, chrono_tz::Australia::Lord_Howe);
        let got = occurrences(&s, utc("2026-04-04T00:00:00Z"), utc("2026-04-05T12:00:00Z"));
        assert_eq!(got, vec![utc("2026-04-05T01:45:00+11:00")]);
    }

    #[test]
    fn weekly_only_on_its_days() {
        let s = Schedule::Weekly {
            days: WeekdaySet::new([Weekday::Mon, Weekday::Fri]).expect("days"),
            time: TimeOfDay::new(9, 0).expect("time"),
            zone: chrono_tz::Europe::London,
        };
        // 2026-11-30 is a Monday.
        let got = occurrences(&s, utc("2026-11-29T00:00:00Z"), utc("2026-12-08T00:00:00Z"));
        assert_eq!(
            got,
            vec![
                utc("2026-11-30T09:00:00Z"),
                utc("2026-12-04T09:00:00Z"),
                utc("2026-12-07T09:00:00Z"),
            ]
        );
    }

    #[test]
    fn once_fires_only_in_the_future() {
        let at = utc("2026-12-01T10:00:00Z");
        let s = Schedule::Once { at };
        assert_eq!(s.next_after(utc("2026-11-30T00:00:00Z")), Some(at));
        assert_eq!(s.next_after(at), None);
    }

    #[test]
    fn record_round_trip() {
        for s in [
            Schedule::Once {
                at: utc("2026-12-01T10:00:00.123456Z"),
            },
            daily(7, 5, chrono_tz::Asia::Kolkata),
            Schedule::Weekly {
                days: WeekdaySet::new([Weekday::Sun, Weekday::Wed]).expect("days"),
                time: TimeOfDay::new(23, 59).expect("time"),
                zone: chrono_tz::Pacific::Apia,
            },
        ] {
            let json = serde_json::to_string(&ScheduleRecord::from(&s)).expect("json");
            let back: ScheduleRecord = serde_json::from_str(&json).expect("parse");
            assert_eq!(Schedule::try_from(back).expect("valid"), s);
        }
    }

    #[test]
    fn occurrences_cross_the_next_offset_change() {
        let paris = parse_time_zone("Europe/Paris").expect("zone");
        let after = Utc
            .with_ymd_and_hms(2027, 3, 20, 0, 0, 0)
            .single()
            .expect("t");
        let change = next_offset_change(paris, after, Duration::days(730)).expect("dst");
        // Europe/Paris springs forward at 01:00 UTC on the last Sunday of March.
        assert_eq!(
            change,
            Utc.with_ymd_and_hms(2027, 3, 28, 1, 0, 0)
                .single()
                .expect("t")
        );
        let daily = Schedule::Daily {
            time: TimeOfDay::new(9, 30).expect("time"),
            zone: paris,
        };
        let next = daily.occurrences(change, 2);
        // 09:30 CEST is 07:30 UTC, where it was 08:30 UTC before.
        assert_eq!(
            next[0],
            Utc.with_ymd_and_hms(2027, 3, 28, 7, 30, 0)
                .single()
                .expect("t")
        );
        assert_eq!(daily.occurrences(after, 5).len(), 5);
        let utc = Tz::UTC;
        assert_eq!(next_offset_change(utc, after, Duration::days(730)), None);
        let once = Schedule::Once { at: after };
        assert_eq!(once.occurrences(after, 5), Vec::<DateTime<Utc>>::new());
    }
}
