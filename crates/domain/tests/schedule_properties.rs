//! Property tests of schedules over many IANA zones and dates: occurrences
//! strictly increase, every local day (or chosen weekday) fires exactly once,
//! and each occurrence obeys the DST rules of SPEC §3.

use automesh_domain::schedule::slot_instant;
use automesh_domain::{Schedule, TimeOfDay, WeekdaySet};
use chrono::{DateTime, Datelike, Duration, LocalResult, NaiveDate, TimeZone, Utc, Weekday};
use chrono_tz::{TZ_VARIANTS, Tz};
use proptest::prelude::*;

fn zone() -> impl Strategy<Value = Tz> {
    (0..TZ_VARIANTS.len()).prop_map(|i| TZ_VARIANTS[i])
}

fn time_of_day() -> impl Strategy<Value = TimeOfDay> {
    // Bias towards the small hours, where transitions happen.
    prop_oneof![(0u32..4, 0u32..60), (0u32..24, 0u32..60),]
        .prop_map(|(h, m)| TimeOfDay::new(h, m).expect("valid"))
}

fn date() -> impl Strategy<Value = NaiveDate> {
    (1975i32..2045, 1u32..=365).prop_map(|(y, d)| {
        NaiveDate::from_yo_opt(y, d).unwrap_or(NaiveDate::from_ymd_opt(y, 1, 1).expect("date"))
    })
}

/// The local dates from `start`, one slot each, deduplicated where a skipped
/// day's slot resolves onto the next day's.
fn expected(
    zone: Tz,
    time: TimeOfDay,
    dates: impl Iterator<Item = NaiveDate>,
) -> Vec<(NaiveDate, DateTime<Utc>)> {
    let mut out: Vec<(NaiveDate, DateTime<Utc>)> =
        dates.map(|d| (d, slot_instant(zone, d, time))).collect();
    out.dedup_by_key(|(_, t)| *t);
    out
}

fn instants(v: &[(NaiveDate, DateTime<Utc>)]) -> Vec<DateTime<Utc>> {
    v.iter().map(|(_, t)| *t).collect()
}

fn take(s: &Schedule, from: DateTime<Utc>, n: usize) -> Vec<DateTime<Utc>> {
    let mut out = Vec::with_capacity(n);
    let mut t = from;
    for _ in 0..n {
        let Some(next) = s.next_after(t) else { break };
        out.push(next);
        t = next;
    }
    out
}

/// The DST rules for one slot: exact local time when it exists (the first of
/// two when ambiguous), else the first instant after the missing time.
fn check_slot(
    zone: Tz,
    d: NaiveDate,
    time: TimeOfDay,
    t: DateTime<Utc>,
) -> Result<(), TestCaseError> {
    let wanted = d.and_hms_opt(time.hour(), time.minute(), 0).expect("time");
    match zone.from_local_datetime(&wanted) {
        LocalResult::Single(x) => prop_assert_eq!(x.with_timezone(&Utc), t),
        LocalResult::Ambiguous(a, b) => prop_assert_eq!(a.min(b).with_timezone(&Utc), t),
        LocalResult::None => {
            let local = t.with_timezone(&zone).naive_local();
            let before = (t - Duration::seconds(1))
                .with_timezone(&zone)
                .naive_local();
            prop_assert!(local > wanted, "{local} not after {wanted}");
            prop_assert!(before < wanted, "{before} not before {wanted}");
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn daily_fires_every_day_once_in_order(zone in zone(), time in time_of_day(), start in date()) {
        let s = Schedule::Daily { time, zone };
        let from = slot_instant(zone, start, time) - Duration::seconds(1);
        let got = take(&s, from, 40);
        prop_assert!(got.windows(2).all(|w| w[0] < w[1]), "not strictly increasing");
        let want = expected(zone, time, (0..45).map(|i| start + Duration::days(i)));
        prop_assert_eq!(&got[..], &instants(&want)[..got.len()]);
        for (d, t) in &want[..got.len()] {
            check_slot(zone, *d, time, *t)?;
        }
    }

    #[test]
    fn weekly_fires_on_its_days_only(
        zone in zone(),
        time in time_of_day(),
        start in date(),
        mask in 1u8..128,
    ) {
        let days = WeekdaySet::new((0..7u8).filter(|i| mask & (1 << i) != 0).filter_map(|i| Weekday::try_from(i).ok()))
            .expect("non-empty");
        let s = Schedule::Weekly { days, time, zone };
        let from = slot_instant(zone, start, time) - Duration::seconds(1);
        let got = take(&s, from, 20);
        prop_assert!(got.windows(2).all(|w| w[0] < w[1]), "not strictly increasing");
        let dates: Vec<NaiveDate> = (0..200)
            .map(|i| start + Duration::days(i))
            .filter(|d| days.contains(d.weekday()))
            .collect();
        let want = expected(zone, time, dates.iter().copied());
        prop_assert_eq!(&got[..], &instants(&want)[..got.len()]);
    }

    #[test]
    fn next_after_is_the_first_strictly_later(zone in zone(), time in time_of_day(), start in date(), offset_s in 0i64..172_800) {
        let s = Schedule::Daily { time, zone };
        let after = slot_instant(zone, start, time) + Duration::seconds(offset_s) - Duration::days(1);
        let next = s.next_after(after).expect("daily always has a next");
        prop_assert!(next > after);
        // Nothing fires in between: the slot of every nearby day is <= after or >= next.
        for i in -3..4 {
            let t = slot_instant(zone, start + Duration::days(i), time);
            prop_assert!(t <= after || t >= next, "slot {t} skipped between {after} and {next}");
        }
    }
}

#[test]
fn europe_london_transitions() {
    let london = chrono_tz::Europe::London;
    // 2026-03-29: 01:00 GMT jumps to 02:00 BST; 01:30 fires at 02:00 BST.
    let t = slot_instant(
        london,
        NaiveDate::from_ymd_opt(2026, 3, 29).expect("d"),
        TimeOfDay::new(1, 30).expect("t"),
    );
    assert_eq!(
        t,
        DateTime::parse_from_rfc3339("2026-03-29T01:00:00Z")
            .expect("t")
            .with_timezone(&Utc)
    );
    // 2026-10-25: 02:00 BST falls back to 01:00 GMT; 01:30 fires at the BST one.
    let t = slot_instant(
        london,
        NaiveDate::from_ymd_opt(2026, 10, 25).expect("d"),
        TimeOfDay::new(1, 30).expect("t"),
    );
    assert_eq!(
        t,
        DateTime::parse_from_rfc3339("2026-10-25T00:30:00Z")
            .expect("t")
            .with_timezone(&Utc)
    );
}

#[test]
fn samoa_skipped_day_fires_once_at_the_next_valid_instant() {
    // Pacific/Apia skipped 2011-12-30 entirely.
    let apia = chrono_tz::Pacific::Apia;
    let s = Schedule::Daily {
        time: TimeOfDay::new(9, 0).expect("t"),
        zone: apia,
    };
    let from = DateTime::parse_from_rfc3339("2011-12-28T00:00:00Z")
        .expect("t")
        .with_timezone(&Utc);
    let got: Vec<String> = take(&s, from, 4)
        .into_iter()
        .map(|t| t.with_timezone(&apia).format("%F %R").to_string())
        .collect();
    assert_eq!(
        got,
        [
            "2011-12-28 09:00",
            "2011-12-29 09:00",
            "2011-12-31 00:00",
            "2011-12-31 09:00"
        ]
    );
}
