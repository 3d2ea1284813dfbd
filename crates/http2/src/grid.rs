//! A timer grid shared by every connection of a process: deadlines rounded
//! up to a multiple of one step from one epoch, so that timers set at
//! nearby instants (the keepalive PINGs of thousands of idle connections)
//! fire in one wake-up instead of one each.

use std::time::{Duration, Instant};

/// Deadlines rounded up to a grid of `grid` steps from a process-wide epoch.
#[derive(Debug, Clone)]
pub struct GridTimer {
    epoch: Instant,
    grid: Duration,
}

impl GridTimer {
    /// A grid of `grid` steps (at least a millisecond).
    pub fn new(grid: Duration) -> Self {
        static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        Self {
            epoch: *EPOCH.get_or_init(Instant::now),
            grid: grid.max(Duration::from_millis(1)),
        }
    }

    /// The first grid point at or after `at`.
    pub fn round(&self, at: Instant) -> Instant {
        let since = at.saturating_duration_since(self.epoch).as_nanos();
        let grid = self.grid.as_nanos();
        let steps = since.div_ceil(grid);
        self.epoch + Duration::from_nanos(u64::try_from(steps * grid).unwrap_or(u64::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_deadlines_round_up_to_one_shared_grid() {
        let timer = GridTimer::new(Duration::from_millis(250));
        let now = Instant::now();
        let a = timer.round(now + Duration::from_millis(4_010));
        let b = timer.round(now + Duration::from_millis(4_200));
        // Never early, at most one step late.
        assert!(a >= now + Duration::from_millis(4_010));
        assert!(a < now + Duration::from_millis(4_010 + 250));
        // On the grid: rounding again changes nothing, and nearby
        // deadlines share a point or are a whole number of steps apart.
        assert_eq!(timer.round(a), a);
        let apart = b.duration_since(a).as_millis();
        assert!(apart == 0 || apart == 250, "{apart}");
    }
}
