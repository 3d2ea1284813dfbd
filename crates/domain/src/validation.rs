//! Field violations: what was wrong with a request, and where. The gateway
//! returns them as INVALID_ARGUMENT with the standard `BadRequest` details.

use std::fmt;

/// One offending field, named by its path in the public request
/// (for example `automation.schedule.daily.time_zone`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldViolation {
    pub field: String,
    pub description: String,
}

impl FieldViolation {
    pub fn new(field: impl Into<String>, description: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            description: description.into(),
        }
    }
}

/// Every violation found in one request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Violations(Vec<FieldViolation>);

impl Violations {
    pub fn push(&mut self, v: FieldViolation) {
        self.0.push(v);
    }

    pub fn field(&mut self, field: impl Into<String>, description: impl Into<String>) {
        self.push(FieldViolation::new(field, description));
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = &FieldViolation> {
        self.0.iter()
    }

    /// `Ok(value)` when nothing was wrong.
    pub fn into_result<T>(self, value: T) -> Result<T, Violations> {
        if self.0.is_empty() {
            Ok(value)
        } else {
            Err(self)
        }
    }
}

impl fmt::Display for Violations {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self
            .0
            .iter()
            .map(|v| format!("{}: {}", v.field, v.description))
            .collect();
        f.write_str(&parts.join("; "))
    }
}

impl std::error::Error for Violations {}

/// How long a text field may be, in the unit its contract documents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// Unicode characters (scalar values): a 200-character Greek or CJK name
    /// fits a 200-character limit.
    Chars(usize),
    /// UTF-8 bytes.
    Bytes(usize),
}

/// Checks a required, bounded text field: not blank, within its limit, and
/// without U+0000 (which PostgreSQL cannot store in text, so no backend
/// accepts it).
pub fn check_text(v: &mut Violations, field: &str, value: &str, limit: Limit) {
    if value.trim().is_empty() {
        v.field(field, "must not be empty");
        return;
    }
    match limit {
        Limit::Chars(max) if value.chars().count() > max => {
            v.field(field, format!("must be at most {max} characters"));
        }
        Limit::Bytes(max) if value.len() > max => {
            v.field(field, format!("must be at most {max} bytes"));
        }
        _ => {}
    }
    check_no_nul(v, field, value);
}

/// Refuses U+0000 in any text a request carries (ids, tokens, names).
pub fn check_no_nul(v: &mut Violations, field: &str, value: &str) {
    if value.contains('\0') {
        v.field(field, "must not contain the NUL character (U+0000)");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_count_what_the_contract_says() {
        let mut v = Violations::default();
        // 200 Greek letters are 400 bytes, and fit 200 characters.
        check_text(&mut v, "name", &"λ".repeat(200), Limit::Chars(200));
        check_text(&mut v, "key", &"語".repeat(200), Limit::Chars(200));
        assert!(v.is_empty(), "{v}");
        check_text(&mut v, "name", &"λ".repeat(201), Limit::Chars(200));
        check_text(&mut v, "prompt", &"λ".repeat(101), Limit::Bytes(200));
        check_text(&mut v, "nul", "a\0b", Limit::Chars(200));
        check_text(&mut v, "blank", "  ", Limit::Chars(200));
        let fields: Vec<&str> = v.iter().map(|f| f.field.as_str()).collect();
        assert_eq!(fields, ["name", "prompt", "nul", "blank"], "{v}");
    }
}
