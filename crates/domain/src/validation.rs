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

/// Checks a required, bounded text field.
pub fn check_text(v: &mut Violations, field: &str, value: &str, max_bytes: usize) {
    if value.trim().is_empty() {
        v.field(field, "must not be empty");
    } else if value.len() > max_bytes {
        v.field(field, format!("must be at most {max_bytes} bytes"));
    }
}
