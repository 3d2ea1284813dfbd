//! Parsing of configuration values shared by every process's flags.

/// Parses `500ms`, `90s`, `30m`, `2h` or a bare number of seconds (for
/// duration flags).
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    use std::time::Duration;
    let s = s.trim();
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map_or((s, "s"), |i| s.split_at(i));
    let n: u64 = num
        .parse()
        .map_err(|_| format!("expected a duration such as 500ms, 90s, 30m or 2h, got {s:?}"))?;
    Ok(match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n * 60),
        "h" => Duration::from_secs(n * 3600),
        _ => {
            return Err(format!(
                "unknown duration unit {unit:?} in {s:?}; use ms, s, m or h"
            ));
        }
    })
}
