//! `PreviewSchedule`: a schedule's next occurrences, computed here from the
//! domain's schedule rules (the ones the scheduler fires by), with nothing
//! read or saved.

use automesh_domain::schedule::next_offset_change;
use automesh_edge::convert;
use automesh_edge::status;
use automesh_proto::v1 as pb;
use chrono::{DateTime, Offset, Utc};
use chrono_tz::Tz;
use tonic::{Request, Status};

use crate::Gateway;

/// The most occurrences one preview lists.
const MOST: i32 = 50;
/// How far ahead the zone's next offset change is looked for.
const CHANGE_WITHIN_DAYS: i64 = 730;

impl Gateway {
    pub(crate) fn preview(
        &self,
        request: Request<pb::PreviewScheduleRequest>,
    ) -> Result<pb::PreviewScheduleResponse, Status> {
        self.principal(&request)?;
        let req = request.into_inner();
        let now = Utc::now();
        let mut v = automesh_domain::Violations::default();
        if !(0..=MOST).contains(&req.count) {
            v.field("count", format!("must be between 1 and {MOST} (0 means 5)"));
        }
        let after = match &req.after_time {
            Some(t) => convert::from_timestamp(t).unwrap_or_else(|| {
                v.field("after_time", "is not a valid timestamp");
                now
            }),
            None => now,
        };
        let schedule = convert::schedule_from_pb(req.schedule.as_ref(), "schedule", now, &mut v);
        let Some(schedule) = schedule.filter(|_| v.is_empty()) else {
            return Err(status::invalid_argument(&v));
        };
        let zone = schedule.zone();
        let count = if req.count == 0 {
            5
        } else {
            req.count as usize
        };
        let times = schedule.occurrences(after, count);
        let change = match (&schedule, times.first()) {
            (automesh_domain::Schedule::Once { .. }, _) | (_, None) => None,
            (_, Some(first)) => {
                next_offset_change(zone, *first, chrono::Duration::days(CHANGE_WITHIN_DAYS))
            }
        };
        let across = change.and_then(|c| schedule.next_after(c - chrono::Duration::seconds(1)));
        Ok(pb::PreviewScheduleResponse {
            occurrences: times.iter().map(|t| occurrence(*t, zone)).collect(),
            time_zone: zone.name().to_owned(),
            next_offset_change_time: across.and(change).map(convert::timestamp),
            first_after_offset_change: change.and(across).map(|t| occurrence(t, zone)),
        })
    }
}

fn occurrence(t: DateTime<Utc>, zone: Tz) -> pb::Occurrence {
    let local = t.with_timezone(&zone);
    let abbreviation = local.format("%Z").to_string();
    pb::Occurrence {
        time: Some(convert::timestamp(t)),
        local_time: local.to_rfc3339_opts(chrono::SecondsFormat::Secs, false),
        utc_offset_seconds: local.offset().fix().local_minus_utc(),
        zone_abbreviation: abbreviation,
    }
}
