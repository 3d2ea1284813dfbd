//! Budgets an owner sets on an automation: the calendar month its monthly
//! budget counts, the checks of a budget a request gives, and what a spent
//! month does to the automation.

use chrono::{DateTime, Utc};

use crate::automation::{Attention, Automation, AutomationState};
use crate::error_code::ErrorCode;
use crate::run::MAX_BUDGET;
use crate::validation::Violations;

impl Automation {
    /// Whether it needs attention because its monthly budget is spent.
    pub fn paused_for_budget(&self) -> bool {
        self.state == AutomationState::NeedsAttention
            && self
                .attention
                .as_ref()
                .is_some_and(|x| x.reason == ErrorCode::BudgetExhausted)
    }

    /// Whether its month's `spent` (micro-units) leaves nothing of its
    /// monthly budget: an occurrence or a run-now then does not start.
    pub fn month_spent(&self, spent: i64) -> bool {
        self.monthly_budget_micros
            .is_some_and(|budget| spent >= budget)
    }

    /// Its monthly budget is spent (`spent` of it by `now`): an active
    /// automation needs attention (`budget_exhausted`) and its schedule
    /// pauses until the month ends or its owner raises the budget. `true`
    /// when that changed it.
    pub fn exhaust_budget(&mut self, spent: i64, now: DateTime<Utc>) -> bool {
        if self.state != AutomationState::Active {
            return false;
        }
        let (_, next_month) = month_of(now, self.schedule.zone());
        self.state = AutomationState::NeedsAttention;
        self.next_run_at = None;
        self.attention = Some(Attention {
            reason: ErrorCode::BudgetExhausted,
            message: format!(
                "this month's runs cost {spent} micro-units, the monthly budget is {}; runs resume at {} (the next month in {}) or when the budget is raised",
                self.monthly_budget_micros.unwrap_or_default(),
                next_month.to_rfc3339(),
                self.schedule.zone()
            ),
        });
        true
    }

    /// Its paused month is over (or its budget was raised): one that needs
    /// attention for its spent budget is active again, from its first
    /// occurrence at or after `from`. `true` when that changed it.
    pub fn resume_budget(&mut self, from: DateTime<Utc>) -> bool {
        if !self.paused_for_budget() {
            return false;
        }
        self.state = AutomationState::Active;
        self.attention = None;
        self.next_run_at = self
            .schedule
            .next_after(from - chrono::Duration::microseconds(1));
        true
    }
}

/// The calendar month of `zone` that `at` falls in: its first instant and
/// the next month's (each the first instant of the 1st's wall-clock day,
/// which is midnight unless a DST gap skips it).
pub fn month_of(at: DateTime<Utc>, zone: chrono_tz::Tz) -> (DateTime<Utc>, DateTime<Utc>) {
    use chrono::{Datelike, NaiveDate, TimeZone};
    let local = at.with_timezone(&zone).date_naive();
    let first = NaiveDate::from_ymd_opt(local.year(), local.month(), 1).unwrap_or(local);
    let next = first
        .checked_add_months(chrono::Months::new(1))
        .unwrap_or(first);
    let start = |day: NaiveDate| {
        // The first instant of the day: midnight, or the end of a gap
        // that swallowed it (probed hour by hour).
        (0..24)
            .find_map(|h| {
                zone.from_local_datetime(&day.and_hms_opt(h, 0, 0)?)
                    .earliest()
            })
            .map_or(at, |t| t.with_timezone(&Utc))
    };
    (start(first), start(next))
}

/// Checks a budget a request gives (`None`: none): 0 up to [`MAX_BUDGET`].
pub fn check_budget(v: &mut Violations, field: &str, value: Option<i64>) -> Option<i64> {
    let value = value?;
    if !(0..=MAX_BUDGET).contains(&value) {
        v.field(
            field,
            format!("must be between 0 and {MAX_BUDGET}, or unset for no cap"),
        );
    }
    Some(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::automation::tests::automation;
    use crate::run::RunState;

    #[test]
    fn months_begin_at_local_midnight_across_dst() {
        let t = |s: &str| {
            DateTime::parse_from_rfc3339(s)
                .map(|t| t.with_timezone(&Utc))
                .unwrap_or_else(|e| panic!("{s}: {e}"))
        };
        let paris = chrono_tz::Europe::Paris;
        // March in Paris begins in winter time (+01:00) and ends in summer
        // time (+02:00): it is an hour short.
        let (start, end) = month_of(t("2027-03-15T12:00:00Z"), paris);
        assert_eq!(start, t("2027-03-01T00:00:00+01:00"));
        assert_eq!(end, t("2027-04-01T00:00:00+02:00"));
        assert_eq!((end - start).num_hours(), 31 * 24 - 1);
        // 23:30 UTC on 31 October is already November in Paris.
        let (start, _) = month_of(t("2027-10-31T23:30:00Z"), paris);
        assert_eq!(start, t("2027-11-01T00:00:00+01:00"));
        // And still October in New York.
        let (start, end) = month_of(t("2027-10-31T23:30:00Z"), chrono_tz::America::New_York);
        assert_eq!(start, t("2027-10-01T00:00:00-04:00"));
        assert_eq!(end, t("2027-11-01T00:00:00-04:00"));
    }

    #[test]
    fn a_spent_month_pauses_until_resumed_and_a_success_does_not_resume_it() {
        let now = Utc::now();
        let mut a = automation(3);
        a.monthly_budget_micros = Some(1_000);
        assert!(!a.month_spent(999));
        assert!(a.month_spent(1_000));
        assert!(a.exhaust_budget(1_000, now));
        assert_eq!(a.state, AutomationState::NeedsAttention);
        assert_eq!(a.next_run_at, None);
        let reason = a.attention.as_ref().map(|x| x.reason);
        assert_eq!(reason, Some(ErrorCode::BudgetExhausted));
        assert!(!a.after_run(RunState::Succeeded, None, None, now));
        assert_eq!(a.state, AutomationState::NeedsAttention);
        assert!(a.resume_budget(now));
        assert_eq!(a.state, AutomationState::Active);
        assert!(a.next_run_at.is_some_and(|t| t >= now));
        assert!(!a.resume_budget(now), "only a spent budget is resumed");
    }
}
