//! Durations on the command line: `5s`, `500ms`, `2m`, `1h` (a bare number is seconds).

use std::time::Duration;

/// Parses a duration; `Err` says what is wrong, for clap.
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration (e.g. 5s, 500ms, 2m)"))?;
    let seconds = match unit.trim() {
        "" | "s" => number,
        "ms" => number / 1e3,
        "us" | "µs" => number / 1e6,
        "m" | "min" => number * 60.0,
        "h" => number * 3600.0,
        other => return Err(format!("unknown time unit {other:?} in {text:?}")),
    };
    Duration::try_from_secs_f64(seconds).map_err(|_| format!("{text:?} is out of range"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_people_write_them() {
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("-1s").is_err());
    }
}
