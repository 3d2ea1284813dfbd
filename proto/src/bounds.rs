//! Size bounds every producer and consumer of these messages shares.
//!
//! A default gRPC client accepts messages of at most 4 MiB. Events are kept
//! well under it, so that any page of them, any `ObserveRun` or `WatchRun`
//! message and any runner report fits:
//!
//! - **One event carries at most [`MAX_EVENT_TEXT_BYTES`] of text per field**
//!   (assistant text, a tool call's input, a tool result's output). Longer
//!   text is cut at a character boundary and ends with a note saying how
//!   long it was; the cut happens where the event is made (the runner, the
//!   worker agent) and again wherever one is received from outside.
//! - **A page of a listing holds at most [`PAGE_BYTE_BUDGET`] encoded
//!   bytes**, whatever `page_size` asks for; it then holds fewer items and
//!   says where to go on (a page token, or `last_sequence` for events).

use prost::Message;

use crate::v1::RunEvent;
use crate::v1::run_event::Payload;

/// The most text one field of one event keeps: 1 MiB.
pub const MAX_EVENT_TEXT_BYTES: usize = 1024 * 1024;

/// The most encoded bytes one page of a listing holds: 3 MiB, under the
/// 4 MiB a default client accepts.
pub const PAGE_BYTE_BUDGET: usize = 3 * 1024 * 1024;

/// `text`, cut to `max` bytes at a character boundary, with a note of what
/// was cut when it was.
pub fn bounded_text(text: &mut String, max: usize) {
    if text.len() <= max {
        return;
    }
    let total = text.len();
    let note = format!("\n… [automesh: cut to {max} of {total} bytes; events keep at most 1 MiB]");
    let mut keep = max.saturating_sub(note.len());
    while !text.is_char_boundary(keep) {
        keep -= 1;
    }
    text.truncate(keep);
    text.push_str(&note);
}

impl RunEvent {
    /// The event with every text field within [`MAX_EVENT_TEXT_BYTES`].
    pub fn bounded(mut self) -> Self {
        match &mut self.payload {
            Some(Payload::AssistantText(t)) => bounded_text(&mut t.text, MAX_EVENT_TEXT_BYTES),
            Some(Payload::ToolCall(c)) => bounded_text(&mut c.input_json, MAX_EVENT_TEXT_BYTES),
            Some(Payload::ToolResult(r)) => bounded_text(&mut r.output, MAX_EVENT_TEXT_BYTES),
            Some(Payload::StatusChange(s)) => bounded_text(&mut s.message, MAX_EVENT_TEXT_BYTES),
            _ => {}
        }
        self
    }
}

/// How many of `items`, from the first, fit one page's byte budget: always
/// at least one (a single item is bounded on its own).
pub fn fitting<T: Message>(items: &[T]) -> usize {
    let mut used = 0;
    for (i, item) in items.iter().enumerate() {
        // The item, its field tag and its length prefix.
        used += item.encoded_len() + 8;
        if used > PAGE_BYTE_BUDGET && i > 0 {
            return i;
        }
    }
    items.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_text_is_cut_at_a_character_boundary_with_a_note() {
        let mut text = "é".repeat(MAX_EVENT_TEXT_BYTES);
        bounded_text(&mut text, MAX_EVENT_TEXT_BYTES);
        assert!(text.len() <= MAX_EVENT_TEXT_BYTES);
        assert!(
            text.ends_with("events keep at most 1 MiB]"),
            "{}",
            &text[text.len() - 80..]
        );
        assert!(text.contains(&format!("of {} bytes", 2 * MAX_EVENT_TEXT_BYTES)));
        let mut short = "short".to_owned();
        bounded_text(&mut short, MAX_EVENT_TEXT_BYTES);
        assert_eq!(short, "short");
    }

    #[test]
    fn pages_stop_at_the_budget_but_hold_one_item() {
        let big = |n: usize| crate::v1::AssistantText {
            text: "x".repeat(n),
        };
        let items = vec![big(MAX_EVENT_TEXT_BYTES); 5];
        assert_eq!(fitting(&items), 2);
        assert_eq!(fitting(&[big(5 * 1024 * 1024)]), 1);
        assert_eq!(fitting(&vec![big(10); 100]), 100);
    }
}
