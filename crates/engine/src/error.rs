//! Keeping error texts clean: an engine fails with an
//! [`automesh_domain::CodedError`] (one of the closed set of error codes),
//! whose message never carries a credential or a URL.

/// `text` with every URL in it replaced by `<url>`: error texts from HTTP
/// clients name the URL they failed on, and a URL may carry a key.
pub fn without_urls(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = ["http://", "https://"]
        .iter()
        .filter_map(|p| rest.find(p))
        .min()
    {
        out.push_str(&rest[..at]);
        out.push_str("<url>");
        let end = rest[at..]
            .find(|c: char| c.is_whitespace() || matches!(c, ')' | '"' | '\'' | '>' | ','))
            .map_or(rest.len(), |i| at + i);
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_removed_from_error_texts() {
        assert_eq!(
            without_urls(
                "error decoding response body for url (https://api.example/v1/chat?key=sk-1)"
            ),
            "error decoding response body for url (<url>)"
        );
        assert_eq!(
            without_urls("a http://a/b and http://c"),
            "a <url> and <url>"
        );
        assert_eq!(without_urls("no address here"), "no address here");
    }
}
