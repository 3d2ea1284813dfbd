//! Opaque page tokens for keyset pagination over (created_at, id), newest
//! first.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

use crate::{Result, StoreError};

/// Where the next page starts: strictly older than this row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    pub created_micros: i64,
    pub id: String,
}

impl Cursor {
    /// The cursor before the first row of any listing.
    pub fn start() -> Cursor {
        Cursor {
            created_micros: i64::MAX,
            id: String::new(),
        }
    }

    /// The cursor just after the row created at `created_at` with `id`
    /// (where a page that stops at that row goes on).
    pub fn after(created_at: chrono::DateTime<chrono::Utc>, id: &str) -> Cursor {
        Cursor {
            created_micros: crate::rows::micros(created_at),
            id: id.to_owned(),
        }
    }

    pub fn encode(&self) -> String {
        URL_SAFE_NO_PAD.encode(format!("{}/{}", self.created_micros, self.id))
    }

    /// Decodes a token; the empty token is the start.
    pub fn decode(token: &str) -> Result<Cursor> {
        if token.is_empty() {
            return Ok(Cursor::start());
        }
        let raw = URL_SAFE_NO_PAD
            .decode(token)
            .map_err(|_| StoreError::InvalidPageToken)?;
        let raw = String::from_utf8(raw).map_err(|_| StoreError::InvalidPageToken)?;
        let (micros, id) = raw.split_once('/').ok_or(StoreError::InvalidPageToken)?;
        Ok(Cursor {
            created_micros: micros.parse().map_err(|_| StoreError::InvalidPageToken)?,
            id: id.to_owned(),
        })
    }
}

/// What a listing pages through, newest first: each item says where a page
/// that ends with it goes on.
pub trait Listed {
    fn cursor(&self) -> Cursor;
}

impl Listed for automesh_domain::Run {
    fn cursor(&self) -> Cursor {
        Cursor::after(self.created_at, &self.id)
    }
}

impl Listed for automesh_domain::Automation {
    fn cursor(&self) -> Cursor {
        Cursor::after(self.created_at, &self.id)
    }
}

/// One page of a listing.
#[derive(Debug, Clone, PartialEq)]
pub struct Page<T> {
    pub items: Vec<T>,
    /// `None` when there are no more rows.
    pub next: Option<Cursor>,
}

impl<T: Listed> Page<T> {
    /// The token of the page after this one once cut to its first `kept`
    /// items (a byte budget, say): after the last kept item, or where it
    /// went on anyway when nothing was cut; empty when nothing follows.
    pub fn next_token(&self, kept: usize) -> String {
        let next = if kept < self.items.len() && kept > 0 {
            Some(self.items[kept - 1].cursor())
        } else {
            self.next.clone()
        };
        next.map(|c| c.encode()).unwrap_or_default()
    }

    /// This page's items as `P`s (`items`, in order), cut to what `fits`
    /// says fits one response, and the token of the page after what was
    /// kept.
    pub fn cut<P>(&self, mut items: Vec<P>, fits: impl Fn(&[P]) -> usize) -> (Vec<P>, String) {
        let kept = fits(&items);
        items.truncate(kept);
        (items, self.next_token(kept))
    }

    /// A page from up to `limit + 1` rows read in listing order: the extra
    /// row, when present, only says that another page follows.
    pub(crate) fn from_rows(mut items: Vec<T>, limit: u32) -> Self {
        let next = if items.len() > limit as usize {
            items.truncate(limit as usize);
            items.last().map(T::cursor)
        } else {
            None
        };
        Page { items, next }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_garbage() {
        let c = Cursor {
            created_micros: 17,
            id: "a/b".into(),
        };
        assert_eq!(Cursor::decode(&c.encode()).ok(), Some(c));
        assert!(Cursor::decode("!!").is_err());
        assert_eq!(Cursor::decode("").ok(), Some(Cursor::start()));
    }
}
