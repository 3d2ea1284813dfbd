//! The engine's error: always one of the closed set of error codes, with a
//! message that never carries a credential.

use automesh_domain::ErrorCode;

/// Why an engine run (or one step of it) failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct EngineError {
    pub code: ErrorCode,
    pub message: String,
}

impl EngineError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}
