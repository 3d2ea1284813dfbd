//! The service the connection tests serve: echo, a large answer, a
//! trailers-only answer, and a held stream that reports what its reader
//! saw and when its response was dropped.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame};
use tokio::sync::mpsc;

use super::super::{RecvBody, StreamError};

/// What the held stream saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Its reader took this many octets.
    Read(usize),
    /// Its request body ended: cleanly, or with this error.
    BodyEnded(Result<(), StreamError>),
    /// Its response body was dropped.
    ResponseDropped,
}

/// A response body: data, then trailers; or held open forever.
pub struct Answer {
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
    held: Option<mpsc::UnboundedSender<Event>>,
}

impl Body for Answer {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if let Some(d) = self.data.take() {
            return Poll::Ready(Some(Ok(Frame::data(d))));
        }
        if let Some(t) = self.trailers.take() {
            return Poll::Ready(Some(Ok(Frame::trailers(t))));
        }
        if self.held.is_some() {
            return Poll::Pending;
        }
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none() && self.held.is_none()
    }
}

impl Drop for Answer {
    fn drop(&mut self) {
        if let Some(events) = &self.held {
            let _ = events.send(Event::ResponseDropped);
        }
    }
}

fn ok_trailers() -> HeaderMap {
    let mut t = HeaderMap::new();
    t.insert("grpc-status", http::HeaderValue::from_static("0"));
    t
}

async fn next(body: &mut RecvBody) -> Option<Result<Frame<Bytes>, StreamError>> {
    std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await
}

/// Answers by path.
pub async fn answer(
    request: http::Request<RecvBody>,
    events: mpsc::UnboundedSender<Event>,
) -> Result<http::Response<Answer>, Infallible> {
    let path = request.uri().path().to_owned();
    let mut body = request.into_body();
    let answer = |data: Vec<u8>| Answer {
        data: (!data.is_empty()).then(|| Bytes::from(data)),
        trailers: Some(ok_trailers()),
        held: None,
    };
    let response = match path.as_str() {
        "/echo" => {
            let mut all = vec![];
            while let Some(frame) = next(&mut body).await {
                match frame.map(Frame::into_data) {
                    Ok(Ok(d)) => all.extend_from_slice(&d),
                    Ok(Err(_)) => {}
                    Err(_) => break,
                }
            }
            answer(all)
        }
        "/big" => answer(vec![b'x'; 100]),
        "/unread" => {
            // Its body is kept, never read; its response never ends.
            tokio::spawn(async move {
                tokio::time::sleep(std::time::Duration::from_secs(30)).await;
                drop(body);
            });
            Answer {
                data: None,
                trailers: None,
                held: Some(events),
            }
        }
        "/trailers-only" => {
            let mut response = http::Response::new(Answer {
                data: None,
                trailers: None,
                held: None,
            });
            response
                .headers_mut()
                .insert("grpc-status", http::HeaderValue::from_static("12"));
            return Ok(response);
        }
        _ => {
            // Held: its reader reports, its response never ends.
            let reports = events.clone();
            tokio::spawn(async move {
                loop {
                    match next(&mut body).await {
                        Some(Ok(f)) => {
                            if let Ok(d) = f.into_data() {
                                let _ = reports.send(Event::Read(d.len()));
                            }
                        }
                        Some(Err(status)) => {
                            let _ = reports.send(Event::BodyEnded(Err(status)));
                            return;
                        }
                        None => {
                            let _ = reports.send(Event::BodyEnded(Ok(())));
                            return;
                        }
                    }
                }
            });
            Answer {
                data: None,
                trailers: None,
                held: Some(events),
            }
        }
    };
    Ok(http::Response::new(response))
}
