//! Timestamps and durations, kept inside the protobuf range.

use chrono::{DateTime, Utc};

#[allow(unused_imports)]
use super::*;

/// The first and last second a `google.protobuf.Timestamp` may hold
/// (0001-01-01T00:00:00Z and 9999-12-31T23:59:59Z): clients reject whole
/// messages carrying anything outside.
pub const TIMESTAMP_MIN_SECONDS: i64 = -62_135_596_800;
pub const TIMESTAMP_MAX_SECONDS: i64 = 253_402_300_799;

/// An instant as a protobuf Timestamp, clamped into the Timestamp range so
/// that no message ever carries an invalid one (what is stored is checked at
/// write time; this is the last line).
pub fn timestamp(t: DateTime<Utc>) -> prost_types::Timestamp {
    let seconds = t.timestamp();
    if seconds > TIMESTAMP_MAX_SECONDS {
        return prost_types::Timestamp {
            seconds: TIMESTAMP_MAX_SECONDS,
            nanos: 999_999_999,
        };
    }
    if seconds < TIMESTAMP_MIN_SECONDS {
        return prost_types::Timestamp {
            seconds: TIMESTAMP_MIN_SECONDS,
            nanos: 0,
        };
    }
    prost_types::Timestamp {
        seconds,
        nanos: t.timestamp_subsec_nanos() as i32,
    }
}

/// A protobuf Timestamp as an instant; `None` outside the Timestamp range or
/// with nanos outside 0..=999,999,999 (an invalid Timestamp).
pub fn from_timestamp(ts: &prost_types::Timestamp) -> Option<DateTime<Utc>> {
    if !(TIMESTAMP_MIN_SECONDS..=TIMESTAMP_MAX_SECONDS).contains(&ts.seconds)
        || !(0..=999_999_999).contains(&ts.nanos)
    {
        return None;
    }
    u32::try_from(ts.nanos)
        .ok()
        .and_then(|n| DateTime::from_timestamp(ts.seconds, n))
}

pub fn duration_from_micros(us: i64) -> prost_types::Duration {
    prost_types::Duration {
        seconds: us.div_euclid(1_000_000),
        nanos: (us.rem_euclid(1_000_000) * 1000) as i32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_never_leave_the_protobuf_range() {
        use chrono::TimeZone;
        let far = Utc
            .with_ymd_and_hms(10_000, 1, 1, 0, 0, 0)
            .single()
            .expect("instant");
        let ts = timestamp(far);
        assert_eq!((ts.seconds, ts.nanos), (TIMESTAMP_MAX_SECONDS, 999_999_999));
        let early = Utc
            .with_ymd_and_hms(-5, 1, 1, 0, 0, 0)
            .single()
            .expect("instant");
        assert_eq!(timestamp(early).seconds, TIMESTAMP_MIN_SECONDS);
        let now = Utc::now();
        assert_eq!(from_timestamp(&timestamp(now)), Some(now));
        for bad in [
            prost_types::Timestamp {
                seconds: TIMESTAMP_MAX_SECONDS + 1,
                nanos: 0,
            },
            prost_types::Timestamp {
                seconds: TIMESTAMP_MIN_SECONDS - 1,
                nanos: 0,
            },
            prost_types::Timestamp {
                seconds: 0,
                nanos: -1,
            },
            prost_types::Timestamp {
                seconds: 0,
                nanos: 1_000_000_000,
            },
        ] {
            assert_eq!(from_timestamp(&bad), None, "{bad:?}");
        }
    }
}
