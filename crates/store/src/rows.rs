//! Conversions between stored columns and domain values.

use std::str::FromStr;

use chrono::{DateTime, Utc};
use sqlx::any::AnyRow;
use sqlx::{Row, ValueRef};

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
    let params = (id, owner.org_id.as_str(), owner.user_id.as_str());
    match optional(db, sql, params, decode).await? {
        Some(row) => Ok(row),
        None => Err(StoreError::NotFound),
    }
}

/// The one row `sql` finds for `key` (`$1`), decoded, or `NotFound`.
pub(crate) async fn by_id<T>(
    db: &sqlx::AnyPool,
    sql: &'static str,
    key: &str,
    decode: fn(&AnyRow) -> Result<T>,
) -> Result<T> {
    let row = optional(db, sql, (key,), decode).await?;
    row.ok_or(StoreError::NotFound)
}

type AnyQuery<'x> = sqlx::query::Query<'x, sqlx::Any, sqlx::any::AnyArguments>;

/// The values of a query's `$1 … $n`, in order, as one tuple (`()` for
/// none). Every query in the store binds its values this way.
pub(crate) trait Params<'q> {
    fn bind_to<'x>(self, query: AnyQuery<'x>) -> AnyQuery<'x>;
}

impl<'q> Params<'q> for () {
    fn bind_to<'x>(self, query: AnyQuery<'x>) -> AnyQuery<'x> {
        query
    }
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
params!(A, B, C, D, E, F, G, H, I, J, K, L, M);
params!(A, B, C, D, E, F, G, H, I, J, K, L, M, N);
params!(A, B, C, D, E, F, G, H, I, J, K, L, M, N, O);
params!(A, B, C, D, E, F, G, H, I, J, K, L, M, N, O, P);
params!(A, B, C, D, E, F, G, H, I, J, K, L, M, N, O, P, Q);
params!(A, B, C, D, E, F, G, H, I, J, K, L, M, N, O, P, Q, R);
params!(A, B, C, D, E, F, G, H, I, J, K, L, M, N, O, P, Q, R, S);
params!(A, B, C, D, E, F, G, H, I, J, K, L, M, N, O, P, Q, R, S, T);
params!(
    A, B, C, D, E, F, G, H, I, J, K, L, M, N, O, P, Q, R, S, T, U
);
params!(
    A, B, C, D, E, F, G, H, I, J, K, L, M, N, O, P, Q, R, S, T, U, V
);
params!(
    A, B, C, D, E, F, G, H, I, J, K, L, M, N, O, P, Q, R, S, T, U, V, W
);
params!(
    A, B, C, D, E, F, G, H, I, J, K, L, M, N, O, P, Q, R, S, T, U, V, W, X
);
params!(
    A, B, C, D, E, F, G, H, I, J, K, L, M, N, O, P, Q, R, S, T, U, V, W, X, Y
);
params!(
    A, B, C, D, E, F, G, H, I, J, K, L, M, N, O, P, Q, R, S, T, U, V, W, X, Y, Z
);
params!(
    A, B, C, D, E, F, G, H, I, J, K, L, M, N, O, P, Q, R, S, T, U, V, W, X, Y, Z, AA
);
params!(
    A, B, C, D, E, F, G, H, I, J, K, L, M, N, O, P, Q, R, S, T, U, V, W, X, Y, Z, AA, AB
);
params!(
    A, B, C, D, E, F, G, H, I, J, K, L, M, N, O, P, Q, R, S, T, U, V, W, X, Y, Z, AA, AB, AC
);
params!(
    A, B, C, D, E, F, G, H, I, J, K, L, M, N, O, P, Q, R, S, T, U, V, W, X, Y, Z, AA, AB, AC, AD
);

/// Whether `db` speaks to PostgreSQL (a job that has a one-statement form
/// there uses it).
pub(crate) fn is_postgres(db: &sqlx::AnyConnection) -> bool {
    db.backend_name() == "PostgreSQL"
}

/// Where a query runs: the pool, or a transaction's connection
/// (`&mut *tx`).
pub(crate) trait Db<'c>: sqlx::Executor<'c, Database = sqlx::Any> {}
impl<'c, E: sqlx::Executor<'c, Database = sqlx::Any>> Db<'c> for E {}

/// Runs the write `sql` with `params`; how many rows it changed.
pub(crate) async fn execute<'c, 'q>(
    db: impl Db<'c>,
    sql: &'static str,
    params: impl Params<'q>,
) -> Result<u64> {
    let done = params.bind_to(sqlx::query(sql)).execute(db).await?;
    Ok(done.rows_affected())
}

/// Runs the guarded write `sql` with `params`: true when it changed exactly
/// the one row it guards (the write won), false when its guard held it off.
pub(crate) async fn changed_one<'c, 'q>(
    db: impl Db<'c>,
    sql: &'static str,
    params: impl Params<'q>,
) -> Result<bool> {
    Ok(execute(db, sql, params).await? == 1)
}

/// Every row `sql` finds with `params`, decoded.
pub(crate) async fn all<'c, 'q, T>(
    db: impl Db<'c>,
    sql: &'static str,
    params: impl Params<'q>,
    decode: impl Fn(&AnyRow) -> Result<T>,
) -> Result<Vec<T>> {
    let rows = params.bind_to(sqlx::query(sql)).fetch_all(db).await?;
    rows.iter().map(decode).collect()
}

/// `decode` for a batch that must not fail as a whole: a row that does not
/// decode is logged (as `what`) and skipped, left to whatever bounds it.
pub(crate) fn skipping<T>(
    what: &'static str,
    decode: fn(&AnyRow) -> Result<T>,
) -> impl Fn(&AnyRow) -> Result<Option<T>> {
    move |row| {
        Ok(decode(row)
            .inspect_err(|error| tracing::error!(%error, "{what} does not decode; skipped"))
            .ok())
    }
}

/// The row `sql` finds with `params`, if any, decoded (the first, were
/// there more).
pub(crate) async fn optional<'c, 'q, T, D>(
    db: impl Db<'c>,
    sql: &'static str,
    params: impl Params<'q>,
    decode: D,
) -> Result<Option<T>>
where
    D: Fn(&AnyRow) -> Result<T>,
{
    Ok(all(db, sql, params, decode).await?.into_iter().next())
}

/// One page of up to `limit` of what the keyset query `sql` finds with
/// `params`: its last parameter, after them, is bound here to one row more,
/// which tells whether another page follows.
pub(crate) async fn page<'c, 'q, T: crate::page::Listed>(
    db: impl Db<'c>,
    sql: &'static str,
    params: impl Params<'q>,
    limit: u32,
    decode: fn(&AnyRow) -> Result<T>,
) -> Result<crate::page::Page<T>> {
    let query = params.bind_to(sqlx::query(sql)).bind(i64::from(limit) + 1);
    let rows = query.fetch_all(db).await?;
    let items = rows.iter().map(decode).collect::<Result<_>>()?;
    Ok(crate::page::Page::from_rows(items, limit))
}

/// The column `name` of `row`, read as the type asked for.
pub(crate) fn col<T: Column>(row: &AnyRow, name: &str) -> Result<T> {
    T::read(row, name)
}

/// A value the store keeps in one column, read by its type: text, an
/// integer, a flag (0 or 1), an instant (microseconds since the Unix
/// epoch), a body (hex text), one of a closed set of names, or any of these
/// where the column is nullable.
pub(crate) trait Column: Sized {
    fn read(row: &AnyRow, col: &str) -> Result<Self>;
}

/// Columns sqlx reads as they are.
macro_rules! plain {
    ($($t:ty),+) => {
        $(impl Column for $t {
            fn read(row: &AnyRow, col: &str) -> Result<Self> {
                Ok(row.try_get(col)?)
            }
        })+
    };
}

plain!(String, i64);

impl Column for bool {
    fn read(row: &AnyRow, col: &str) -> Result<Self> {
        Ok(i64::read(row, col)? != 0)
    }
}

impl Column for DateTime<Utc> {
    fn read(row: &AnyRow, col: &str) -> Result<Self> {
        let v = i64::read(row, col)?;
        DateTime::from_timestamp_micros(v).ok_or_else(|| StoreError::Corrupt(format!("{col}={v}")))
    }
}

impl Column for Vec<u8> {
    fn read(row: &AnyRow, col: &str) -> Result<Self> {
        from_hex(&String::read(row, col)?)
    }
}

impl<T: Column> Column for Option<T> {
    fn read(row: &AnyRow, col: &str) -> Result<Self> {
        if row.try_get_raw(col)?.is_null() {
            return Ok(None);
        }
        T::read(row, col).map(Some)
    }
}

/// JSON kept as text (a schedule, an event's payload).
macro_rules! json {
    ($($t:ty => $through:ty),+) => {
        $(impl Column for $t {
            fn read(row: &AnyRow, col: &str) -> Result<Self> {
                let text = String::read(row, col)?;
                let value: $through = serde_json::from_str(&text)
                    .map_err(|e| StoreError::Corrupt(format!("{col}: {e}")))?;
                <$t>::try_from(value).map_err(|e| StoreError::Corrupt(format!("{col}: {e}")))
            }
        })+
    };
}

json!(
    automesh_domain::Schedule => automesh_domain::schedule::ScheduleRecord,
    automesh_domain::RunEventPayload => automesh_domain::RunEventPayload
);

/// `Ok(T { field: col(row, "field")?, … })`: a `T` whose every field is the
/// row's column of the same name, or of the name given (`field = "column"`);
/// fields after a `;` are the variables of their names.
macro_rules! columns {
    ($row:expr => $t:ident {
        $($field:ident $(= $column:literal)?),+ $(,)? $(; $($own:ident),+ $(,)?)?
    }) => {
        Ok($t {
            $($field: $crate::rows::col($row, $crate::rows::columns!(@name $field $($column)?))?,)+
            $($($own,)+)?
        })
    };
    (@name $field:ident) => { stringify!($field) };
    (@name $field:ident $column:literal) => { $column };
}
pub(crate) use columns;

/// A closed set of names kept as text (the domain's enums, the dispatch
/// phases): read through its `FromStr`, a name outside the set is corrupt.
pub(crate) trait Named: FromStr {}

impl<T: Named> Column for T {
    fn read(row: &AnyRow, col: &str) -> Result<Self> {
        let v = String::read(row, col)?;
        v.parse()
            .map_err(|_| StoreError::Corrupt(format!("{col}={v:?}")))
    }
}

macro_rules! named {
    ($($t:ty),+) => { $(impl Named for $t {})+ };
}

named!(
    automesh_domain::Placement,
    automesh_domain::Surface,
    automesh_domain::AutomationState,
    automesh_domain::RunTrigger,
    automesh_domain::RunState,
    automesh_domain::ErrorCode,
    automesh_domain::WorkerState,
    crate::cloud::CloudPhase,
    crate::desktop::DesktopPhase
);

/// A budget per run, as its row keeps it (`max_cost_micros`, `max_tokens`).
pub(crate) fn budget(row: &AnyRow) -> Result<automesh_domain::RunBudget> {
    Ok(automesh_domain::RunBudget {
        max_cost_micros: col(row, "max_cost_micros")?,
        max_tokens: col(row, "max_tokens")?,
    })
}

/// An instant as stored: microseconds since the Unix epoch.
pub(crate) fn micros(t: DateTime<Utc>) -> i64 {
    t.timestamp_micros()
}

pub(crate) fn opt_micros(t: Option<DateTime<Utc>>) -> Option<i64> {
    t.map(micros)
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
