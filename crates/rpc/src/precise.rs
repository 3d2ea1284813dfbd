//! Sleeping to an instant within microseconds: the scheduler wakes ahead
//! of a due instant, and a coordinator holds a run created ahead of its
//! instant until that instant, not until a millisecond timer gets to it.

use std::time::Duration;

/// How long before its end a sleep leaves tokio's timer, which rounds a
/// deadline up to its next millisecond tick and its park timeout up again
/// (up to two milliseconds late), for the operating system's.
const PRECISE: Duration = Duration::from_millis(3);

/// How long before its end a sleep leaves the operating system's timer
/// (a tenth of a millisecond late on a virtual machine, and as much again
/// to wake the task) to yield until the instant.
const SPIN: Duration = Duration::from_micros(500);

/// Sleeps `d`, waking within microseconds of its end, never before it
/// (tokio's timer alone wakes up to two milliseconds late).
/// Tokio's timer, then a blocking sleep on the blocking pool (dropped
/// early, its thread finishes that stretch alone), then yielding for the
/// last half millisecond.
pub async fn sleep_precisely(d: Duration) {
    let until = std::time::Instant::now() + d;
    if d > PRECISE {
        tokio::time::sleep(d - PRECISE).await;
    }
    let left = until.saturating_duration_since(std::time::Instant::now());
    if left > SPIN {
        let stretch = left - SPIN;
        if tokio::task::spawn_blocking(move || std::thread::sleep(stretch))
            .await
            .is_err()
        {
            // No blocking pool (the runtime is shutting down): the timer.
            tokio::time::sleep(stretch).await;
        }
    }
    while std::time::Instant::now() < until {
        tokio::task::yield_now().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run is never held short of its instant: however its three
    /// stretches fall (tokio's timer, the blocking sleep, yielding), the
    /// sleep never ends early.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_precise_sleep_never_ends_early() {
        for micros in [0, 50, 400, 600, 2_000, 3_500, 7_000] {
            let d = Duration::from_micros(micros);
            let until = std::time::Instant::now() + d;
            sleep_precisely(d).await;
            assert!(
                std::time::Instant::now() >= until,
                "a sleep of {d:?} ended early"
            );
        }
    }
}
