//! Conversions between protobuf messages and domain types, and the request
//! validation that comes with them. Handlers call these at the edge, so
//! protobuf types never reach the store.
//!
//! One module per kind of thing: principals, time, enums, schedules,
//! automations, runs (with usage and events). Everything is re-exported
//! here, so callers write `convert::timestamp`, `convert::run_to_pb`.

mod automations;
mod enums;
mod principals;
mod runs;
mod schedules;
mod time;

pub use automations::*;
pub use enums::*;
pub use principals::*;
pub use runs::*;
pub use schedules::*;
pub use time::*;

/// Largest page any listing returns.
pub const MAX_PAGE_SIZE: u32 = 1000;
