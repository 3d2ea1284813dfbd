//! Time shown honestly: every timestamp names its zone, and one toggle
//! switches the whole console between the viewer's local zone and UTC.
//!
//! The page's script records the browser's IANA zone in a cookie
//! (`automesh_tz`) and the toggle in another (`automesh_time`); the server
//! renders every instant in the chosen zone. Without the script (or before
//! its first run) everything is in UTC, and says so.

use chrono::{DateTime, TimeZone, Utc};
use chrono_tz::Tz;
use maud::{Markup, html};

/// The cookie holding the browser's IANA time zone.
pub const ZONE_COOKIE: &str = "automesh_tz";
/// The cookie holding the toggle: `utc` or `local`.
pub const MODE_COOKIE: &str = "automesh_time";

/// How the viewer sees instants.
#[derive(Debug, Clone, Copy)]
pub struct Viewer {
    /// The browser's zone, when the script reported a valid one.
    pub local: Option<Tz>,
    /// Whether the toggle asks for UTC.
    pub utc: bool,
}

impl Viewer {
    pub fn from_headers(headers: &http::HeaderMap) -> Self {
        let local = crate::session::cookie(headers, ZONE_COOKIE)
            .map(|z| z.replace("%2F", "/"))
            .and_then(|z| automesh_domain::schedule::parse_time_zone(&z));
        let utc = crate::session::cookie(headers, MODE_COOKIE) == Some("utc");
        Self { local, utc }
    }

    /// The zone instants are shown in.
    pub fn zone(&self) -> Tz {
        match self.local {
            Some(z) if !self.utc => z,
            _ => Tz::UTC,
        }
    }

    /// Whether instants are shown in UTC.
    pub fn shows_utc(&self) -> bool {
        self.zone() == Tz::UTC
    }

    /// `instant` in the viewer's zone, naming it; the UTC instant is in the
    /// element's `datetime` and its title.
    pub fn at(&self, instant: DateTime<Utc>) -> Markup {
        in_zone(instant, self.zone())
    }

    /// A protobuf timestamp, or a dash when unset.
    pub fn ts(&self, t: &Option<prost_types::Timestamp>) -> Markup {
        match t.as_ref().and_then(instant) {
            Some(i) => self.at(i),
            None => html! { span.none { "—" } },
        }
    }
}

/// `instant` shown in `zone`, naming the zone.
pub fn in_zone(instant: DateTime<Utc>, zone: Tz) -> Markup {
    let utc = instant.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let local = zone.from_utc_datetime(&instant.naive_utc());
    html! {
        time datetime=(utc) title=(format!("{} UTC", instant.format("%Y-%m-%d %H:%M:%S"))) {
            (local.format("%Y-%m-%d %H:%M")) " " (zone_label(zone, &local))
        }
    }
}

/// The zone's abbreviation at that instant (`CET`, `EDT`), or its IANA name
/// when the zone has no letters for it (`+03`).
fn zone_label(zone: Tz, local: &DateTime<Tz>) -> String {
    let abbreviation = local.format("%Z").to_string();
    if zone == Tz::UTC {
        "UTC".to_owned()
    } else if abbreviation.starts_with(['+', '-']) {
        format!("{} ({})", zone.name(), abbreviation)
    } else {
        abbreviation
    }
}

/// A protobuf timestamp as an instant.
pub fn instant(t: &prost_types::Timestamp) -> Option<DateTime<Utc>> {
    DateTime::from_timestamp(t.seconds, u32::try_from(t.nanos).ok()?)
}

/// An instant as a protobuf timestamp.
pub fn timestamp(t: DateTime<Utc>) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: t.timestamp(),
        nanos: i32::try_from(t.timestamp_subsec_nanos()).unwrap_or(0),
    }
}

/// A duration as people read it: `850 ms`, `12.4 s`, `3 min 5 s`.
pub fn duration(d: &Option<prost_types::Duration>) -> String {
    let Some(d) = d else {
        return "—".to_owned();
    };
    let ms = d.seconds * 1000 + i64::from(d.nanos) / 1_000_000;
    if ms < 1000 {
        format!("{ms} ms")
    } else if ms < 60_000 {
        format!("{:.1} s", ms as f64 / 1000.0)
    } else {
        format!("{} min {} s", ms / 60_000, (ms % 60_000) / 1000)
    }
}

/// Cost in millionths of the currency unit, as `$0.001234`.
pub fn cost(micros: i64) -> String {
    format!("${}.{:06}", micros / 1_000_000, (micros % 1_000_000).abs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_instant_names_its_zone_and_keeps_utc_in_its_attributes() {
        let t = Utc
            .with_ymd_and_hms(2026, 7, 1, 12, 0, 0)
            .single()
            .expect("t");
        let paris = in_zone(t, chrono_tz::Europe::Paris).into_string();
        assert!(paris.contains("2026-07-01 14:00 CEST"), "{paris}");
        assert!(
            paris.contains("datetime=\"2026-07-01T12:00:00Z\""),
            "{paris}"
        );
        let utc = in_zone(t, Tz::UTC).into_string();
        assert!(utc.contains("12:00 UTC"), "{utc}");
        let dubai = in_zone(t, chrono_tz::Asia::Dubai).into_string();
        assert!(dubai.contains("Asia/Dubai (+04)"), "{dubai}");
    }

    #[test]
    fn the_toggle_chooses_utc_over_the_browser_zone() {
        let mut headers = http::HeaderMap::new();
        headers.insert(
            http::header::COOKIE,
            "automesh_tz=America%2FNew_York".parse().expect("h"),
        );
        assert_eq!(
            Viewer::from_headers(&headers).zone(),
            chrono_tz::America::New_York
        );
        headers.insert(
            http::header::COOKIE,
            "automesh_tz=America/New_York; automesh_time=utc"
                .parse()
                .expect("h"),
        );
        assert!(Viewer::from_headers(&headers).shows_utc());
        assert_eq!(cost(1_234), "$0.001234");
        assert_eq!(cost(2_500_000), "$2.500000");
    }
}
