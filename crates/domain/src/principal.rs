//! The caller an operation acts for. Every read and write of tenant data is
//! scoped to one; another tenant's object is simply not found.

/// An authenticated (organisation, user) pair.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Principal {
    pub org_id: String,
    pub user_id: String,
}

impl Principal {
    pub fn new(org_id: impl Into<String>, user_id: impl Into<String>) -> Self {
        Self {
            org_id: org_id.into(),
            user_id: user_id.into(),
        }
    }
}
