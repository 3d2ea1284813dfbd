//! The store's one SQL-building helper, [`bulk!`], and what it builds: the
//! typed row of a write and the statements that take many rows at once.
//!
//! Every write that commits through the writer (`writer.rs`) is a bulk
//! statement: a lone write is a batch of one. Its values are one typed row
//! (a struct `bulk!` declares, its fields serialised by serde), bound once
//! as the statement's only parameter, `$1`, a JSON array of rows. The
//! statement reads them as the relation `i`, whose columns are the row's
//! fields; that relation is the only part of the text that differs between
//! the backends (`json_to_recordset` on PostgreSQL, `json_each` and
//! `json_extract` on SQLite), and `bulk!` spells it for both from the one
//! field list. So a write's guard is written once, in the one statement,
//! and holds for each row as if it were alone.
//!
//! Column lists and other shared fragments are `const`s joined with
//! [`const_format::concatcp!`]; no other macro builds SQL.

use std::marker::PhantomData;

use serde::Serialize;
use sqlx::AnyConnection;
use sqlx::any::AnyRow;

use crate::rows;
use crate::{Result, StoreError};

/// A row type a bulk statement takes: its fields as the relation `i`, per
/// backend (declared by [`bulk!`]).
pub(crate) trait Input: Serialize {
    /// The fields, comma-separated, in order (a column list).
    const COLUMNS: &'static str;
    /// `(WITH bulk_input AS MATERIALIZED (SELECT * FROM json_to_recordset($1::json)
    /// AS j(<field> <type>, …)) SELECT * FROM bulk_input) AS i`: the JSON is
    /// parsed once per statement, however often a plan reads `i` (a nested
    /// loop planned from young statistics read a bare `json_to_recordset`
    /// once per row of the other side, parsing it each time).
    const POSTGRES: &'static str;
    /// `(SELECT json_extract(value, '$.<field>') AS <field>, … FROM json_each($1)) AS i`.
    const SQLITE: &'static str;
}

/// A statement over many rows of `R` at once (see the module's docs).
pub(crate) struct Bulk<R> {
    postgres: &'static str,
    sqlite: &'static str,
    row: PhantomData<fn(&R)>,
}

impl<R: Input> Bulk<R> {
    #[doc(hidden)]
    pub(crate) const fn new(postgres: &'static str, sqlite: &'static str) -> Self {
        Bulk {
            postgres,
            sqlite,
            row: PhantomData,
        }
    }

    /// The statement's text for the backend `db` speaks to.
    pub(crate) fn text(&self, db: &AnyConnection) -> &'static str {
        if rows::is_postgres(db) {
            self.postgres
        } else {
            self.sqlite
        }
    }

    /// Both texts (for the tidy tests).
    #[cfg(test)]
    pub(crate) fn texts(&self) -> [&'static str; 2] {
        [self.postgres, self.sqlite]
    }

    /// Every row the statement answers for `rows`, decoded; nothing is
    /// sent for no rows.
    pub(crate) async fn all<T>(
        &self,
        db: &mut AnyConnection,
        rows: &[R],
        decode: impl Fn(&AnyRow) -> Result<T>,
    ) -> Result<Vec<T>> {
        if rows.is_empty() {
            return Ok(vec![]);
        }
        let input = serde_json::to_string(rows)
            .map_err(|e| StoreError::Corrupt(format!("a bulk row: {e}")))?;
        let text = self.text(db);
        crate::writer::counted();
        rows::all(db, text, (input,), decode).await
    }

    /// Runs the statement for `rows`; how many rows it changed.
    pub(crate) async fn execute(&self, db: &mut AnyConnection, rows: &[R]) -> Result<u64> {
        if rows.is_empty() {
            return Ok(0);
        }
        let input = serde_json::to_string(rows)
            .map_err(|e| StoreError::Corrupt(format!("a bulk row: {e}")))?;
        let text = self.text(db);
        crate::writer::counted();
        rows::execute(db, text, (input,)).await
    }
}

/// The one SQL-building macro. Two forms:
///
/// - `bulk! { struct Row { field: RustType => SQLTYPE, … } }` declares a
///   write's row: the struct (serialisable, its fields `pub(crate)`) and its
///   relation `i` on both backends ([`Input`]), from the one field list.
/// - `bulk!(Row => ["before", …] ["after", …])` is a [`Bulk`] statement:
///   the `before` pieces, the relation `i` of `Row`, then the `after`
///   pieces (string literals or `const`s), for each backend.
macro_rules! bulk {
    (
        $(#[$meta:meta])*
        struct $name:ident {
            $($(#[$fmeta:meta])* $field:ident : $ty:ty => $sql:ident),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, serde::Serialize)]
        pub(crate) struct $name {
            $($(#[$fmeta])* pub(crate) $field: $ty,)+
        }

        impl $crate::sql::Input for $name {
            const COLUMNS: &'static str =
                $crate::sql::bulk!(@list $(", ", stringify!($field)),+);
            const POSTGRES: &'static str = const_format::concatcp!(
                "(WITH bulk_input AS MATERIALIZED (SELECT * FROM json_to_recordset($1::json) AS j(",
                $crate::sql::bulk!(@list $(", ", stringify!($field), " ", stringify!($sql)),+),
                ")) SELECT * FROM bulk_input) AS i"
            );
            const SQLITE: &'static str = const_format::concatcp!(
                "(SELECT ",
                $crate::sql::bulk!(@list $(", ", "json_extract(value, '$.", stringify!($field),
                    "') AS ", stringify!($field)),+),
                " FROM json_each($1)) AS i"
            );
        }
    };
    // The pieces of a list, without the leading separator.
    (@list $sep:literal, $($piece:expr),+) => {
        const_format::concatcp!($($piece),+)
    };
    ($row:ty => [$($before:expr),* $(,)?] [$($after:expr),* $(,)?]) => {
        $crate::sql::Bulk::<$row>::new(
            const_format::concatcp!($($before,)* <$row as $crate::sql::Input>::POSTGRES, $($after),*),
            const_format::concatcp!($($before,)* <$row as $crate::sql::Input>::SQLITE, $($after),*),
        )
    };
}
pub(crate) use bulk;

#[cfg(test)]
mod tests {
    use super::{Bulk, Input};

    bulk! {
        /// A row to test with.
        struct Probe {
            id: String => TEXT,
            at: Option<i64> => BIGINT,
        }
    }

    const PROBE: Bulk<Probe> =
        bulk!(Probe => ["UPDATE t SET at = i.at FROM "] [" WHERE t.id = i.id"]);

    #[test]
    fn one_field_list_spells_the_input_for_both_backends() {
        assert_eq!(Probe::COLUMNS, "id, at");
        let [postgres, sqlite] = PROBE.texts();
        assert_eq!(
            postgres,
            "UPDATE t SET at = i.at FROM (WITH bulk_input AS MATERIALIZED (SELECT * FROM \
             json_to_recordset($1::json) AS j(id TEXT, at BIGINT)) SELECT * FROM bulk_input) AS i \
             WHERE t.id = i.id"
        );
        assert_eq!(
            sqlite,
            "UPDATE t SET at = i.at FROM (SELECT json_extract(value, '$.id') AS id, \
             json_extract(value, '$.at') AS at FROM json_each($1)) AS i WHERE t.id = i.id"
        );
        // The rest of the text is one.
        assert_eq!(
            postgres.replace(Probe::POSTGRES, "i"),
            sqlite.replace(Probe::SQLITE, "i")
        );
        let row = Probe {
            id: "r1".into(),
            at: None,
        };
        let json = serde_json::to_string(&[row]).expect("json");
        assert_eq!(json, r#"[{"id":"r1","at":null}]"#);
    }
}
