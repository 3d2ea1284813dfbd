//! Conversions between stored columns and domain values.

use std::str::FromStr;

use chrono::{DateTime, Utc};
use sqlx::Row;
use sqlx::any::AnyRow;

use crate::{Result, StoreError};

/// The one row `sql` finds for `id` within `owner`'s scope (`$1` the id,
/// `$2` the organisation, `$3` the user), decoded; another tenant's row, like
/// a missing one, is `NotFound`.
pub(crate) async fn owned<T>(
    db: &sqlx::AnyPool,
    sql: &'static str,
    owner: &automesh_domain::Principal,
    id: &str,
    decode: fn(&AnyRow) -> Result<T>,
) -> Result<T> {
    let row = sqlx::query(sql)
        .bind(id)
        .bind(&owner.org_id)
        .bind(&owner.user_id)
        .fetch_optional(db)
        .await?
        .ok_or(StoreError::NotFound)?;
    decode(&row)
}

/// The one row `sql` finds for `key` (`$1`), decoded, or `NotFound`.
pub(crate) async fn by_id<T>(
    db: &sqlx::AnyPool,
    sql: &'static str,
    key: &str,
    decode: fn(&AnyRow) -> Result<T>,
) -> Result<T> {
    maybe(db, sql, key, decode)
        .await?
        .ok_or(StoreError::NotFound)
}

/// The row `sql` finds for `key` (`$1`), if any, decoded.
pub(crate) async fn maybe<T>(
    db: &sqlx::AnyPool,
    sql: &'static str,
    key: &str,
    decode: fn(&AnyRow) -> Result<T>,
) -> Result<Option<T>> {
    sqlx::query(sql)
        .bind(key)
        .fetch_optional(db)
        .await?
        .as_ref()
        .map(decode)
        .transpose()
}

type AnyQuery<'x> = sqlx::query::Query<'x, sqlx::Any, sqlx::any::AnyArguments>;

/// The values of a query's `$1 … $n`, in order, as one tuple.
pub(crate) trait Params<'q> {
    fn bind_to<'x>(self, query: AnyQuery<'x>) -> AnyQuery<'x>;
}

macro_rules! params {
    ($($p:ident),+) => {
        impl<'q, $($p),+> Params<'q> for ($($p,)+)
        where
            $($p: sqlx::Encode<'q, sqlx::Any> + sqlx::Type<sqlx::Any>),+
        {
            #[allow(non_snake_case)]
            fn bind_to<'x>(self, query: AnyQuery<'x>) -> AnyQuery<'x> {
                let ($($p,)+) = self;
                query$(.bind($p))+
            }
        }
    };
}

params!(A);
params!(A, B);
params!(A, B, C);
params!(A, B, C, D);
params!(A, B, C, D, E);
params!(A, B, C, D, E, F);
params!(A, B, C, D, E, F, G);
params!(A, B, C, D, E, F, G, H);
params!(A, B, C, D, E, F, G, H, I);
params!(A, B, C, D, E, F, G, H, I, J);
params!(A, B, C, D, E, F, G, H, I, J, K);
params!(A, B, C, D, E, F, G, H, I, J, K, L);

/// Runs the guarded write `sql` with `params`: true when it changed exactly
/// the one row it guards (the write won), false when its guard held it off.
pub(crate) async fn changed_one<'q>(
    db: &sqlx::AnyPool,
    sql: &'static str,
    params: impl Params<'q>,
) -> Result<bool> {
    let done = params.bind_to(sqlx::query(sql)).execute(db).await?;
    Ok(done.rows_affected() == 1)
}

/// An instant as stored: microseconds since the Unix epoch.
pub(crate) fn micros(t: DateTime<Utc>) -> i64 {
    t.timestamp_micros()
}

pub(crate) fn opt_micros(t: Option<DateTime<Utc>>) -> Option<i64> {
    t.map(micros)
}

pub(crate) fn instant(row: &AnyRow, col: &str) -> Result<DateTime<Utc>> {
    let v: i64 = row.try_get(col)?;
    DateTime::from_timestamp_micros(v).ok_or_else(|| StoreError::Corrupt(format!("{col}={v}")))
}

pub(crate) fn opt_instant(row: &AnyRow, col: &str) -> Result<Option<DateTime<Utc>>> {
    let v: Option<i64> = row.try_get(col)?;
    v.map(|v| {
        DateTime::from_timestamp_micros(v).ok_or_else(|| StoreError::Corrupt(format!("{col}={v}")))
    })
    .transpose()
}

pub(crate) fn text(row: &AnyRow, col: &str) -> Result<String> {
    Ok(row.try_get(col)?)
}

pub(crate) fn opt_text(row: &AnyRow, col: &str) -> Result<Option<String>> {
    Ok(row.try_get(col)?)
}

pub(crate) fn int(row: &AnyRow, col: &str) -> Result<i64> {
    Ok(row.try_get(col)?)
}

pub(crate) fn opt_int(row: &AnyRow, col: &str) -> Result<Option<i64>> {
    Ok(row.try_get(col)?)
}

/// A text column holding one of a closed set of names.
pub(crate) fn parsed<T: FromStr>(row: &AnyRow, col: &str) -> Result<T> {
    let v: String = row.try_get(col)?;
    v.parse()
        .map_err(|_| StoreError::Corrupt(format!("{col}={v:?}")))
}

pub(crate) fn opt_parsed<T: FromStr>(row: &AnyRow, col: &str) -> Result<Option<T>> {
    let v: Option<String> = row.try_get(col)?;
    v.map(|v| {
        v.parse()
            .map_err(|_| StoreError::Corrupt(format!("{col}={v:?}")))
    })
    .transpose()
}

/// Bytes as lowercase hex (bodies kept in TEXT columns on both backends).
pub(crate) fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 0xf)] as char);
    }
    s
}

pub(crate) fn from_hex(s: &str) -> Result<Vec<u8>> {
    let corrupt = || StoreError::Corrupt("a stored body is not hex".into());
    if !s.len().is_multiple_of(2) {
        return Err(corrupt());
    }
    s.as_bytes()
        .chunks(2)
        .map(|pair| {
            let digit = |c: u8| (c as char).to_digit(16).ok_or_else(corrupt);
            Ok((digit(pair[0])? << 4 | digit(pair[1])?) as u8)
        })
        .collect()
}
