//! A submitted form or a query string, as its ordered name/value pairs
//! (repeated names kept: checkboxes, weekdays).

use axum::extract::{FromRequest, Request};

use crate::Failure;

/// The most a form body may be (a prompt is at most 32 KiB).
const MAX_FORM_BYTES: usize = 256 * 1024;

#[derive(Debug, Default, Clone)]
pub struct Form(Vec<(String, String)>);

impl Form {
    /// Parses `application/x-www-form-urlencoded` text.
    pub fn parse(text: &[u8]) -> Self {
        Self(
            form_urlencoded::parse(text)
                .map(|(k, v)| (k.into_owned(), v.into_owned()))
                .collect(),
        )
    }

    /// The query string of `uri`.
    pub fn query(uri: &http::Uri) -> Self {
        Self::parse(uri.query().unwrap_or_default().as_bytes())
    }

    /// The first value of `name`.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The first value of `name`, trimmed, or empty.
    pub fn text(&self, name: &str) -> String {
        self.get(name).unwrap_or_default().trim().to_owned()
    }

    /// Every value of `name`, in order.
    pub fn all(&self, name: &str) -> Vec<&str> {
        self.0
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }
}

impl<S: Send + Sync> FromRequest<S> for Form {
    type Rejection = Failure;

    async fn from_request(req: Request, _state: &S) -> Result<Self, Self::Rejection> {
        let body = axum::body::to_bytes(req.into_body(), MAX_FORM_BYTES)
            .await
            .map_err(|_| Failure::BadForm("the form is larger than 256 KiB".to_owned()))?;
        Ok(Self::parse(&body))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_names_keep_every_value() {
        let f = Form::parse(b"ids=a&ids=b&name=%3Cscript%3E+x&empty=");
        assert_eq!(f.all("ids"), vec!["a", "b"]);
        assert_eq!(f.get("name"), Some("<script> x"));
        assert_eq!(f.text("missing"), "");
        assert_eq!(f.get("empty"), Some(""));
    }
}
