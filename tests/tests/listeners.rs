//! What a listener lets in, on the public gateway (hyper's HTTP/2) and the
//! runner listener (the lean one, and hyper's): a connection that sends no
//! request within the first-request bound — none at all, or only the HTTP/2
//! preface — is closed, while one that asked in time stays open as long as
//! it likes; and at its connection cap a listener accepts no more until one
//! closes. Clients here are h2's (the HTTP/2 of hyper and tonic), over real
//! TCP on loopback.

use std::time::Duration;

use automesh_desktop_runner_gateway::stream::{Http2, StreamSettings};
use automesh_e2e_tests::{Mesh, MeshOptions};
use automesh_rpc::runtime::ConnectionLimits;
use automesh_store::Backend;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

const BOUND: Duration = Duration::from_millis(800);

async fn mesh(runner_http2: Http2, max_connections: Option<usize>) -> Mesh {
    Mesh::start_with(
        Backend::Sqlite,
        MeshOptions {
            desktop_via_runner_gateway: true,
            runner_streams: StreamSettings {
                http2: runner_http2,
                ..Default::default()
            },
            connections: Some(ConnectionLimits {
                max_connections,
                first_request_within: BOUND,
            }),
            ..MeshOptions::default()
        },
    )
    .await
    .expect("mesh")
}

fn addr(url: &str) -> String {
    url.trim_start_matches("http://").to_owned()
}

/// Whether the server closes `tcp` (end of input) within `within`,
/// whatever it sent before.
async fn closed_within(tcp: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 4096];
    tokio::time::timeout(within, async {
        loop {
            match tcp.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok()
}

/// An HTTP/2 connection (h2's client) with its connection task.
async fn h2_connect(
    addr: &str,
) -> (
    h2::client::SendRequest<bytes::Bytes>,
    tokio::task::JoinHandle<Result<(), h2::Error>>,
) {
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let (send, connection) = h2::client::handshake(tcp).await.expect("handshake");
    (send, tokio::spawn(connection))
}

/// A gRPC health check on `send`'s connection: its status (`grpc-status`).
async fn health_check(send: &mut h2::client::SendRequest<bytes::Bytes>, addr: &str) -> String {
    let request = http::Request::post(format!("http://{addr}/grpc.health.v1.Health/Check"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .expect("request");
    let mut ready = send.clone().ready().await.expect("ready");
    let (response, mut body) = ready.send_request(request, false).expect("send");
    // An empty HealthCheckRequest: a zero-length gRPC message.
    body.send_data(bytes::Bytes::from_static(&[0, 0, 0, 0, 0]), true)
        .expect("body");
    let response = tokio::time::timeout(Duration::from_secs(10), response)
        .await
        .expect("answered in time")
        .expect("response");
    let mut body = response.into_body();
    while let Some(data) = body.data().await {
        let data = data.expect("data");
        let _ = body.flow_control().release_capacity(data.len());
    }
    let trailers = body.trailers().await.expect("trailers").unwrap_or_default();
    trailers
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("none")
        .to_owned()
}

/// The listeners under test: name and address.
fn listeners(mesh: &Mesh) -> [(&'static str, String); 2] {
    [
        ("public gateway", addr(&mesh.gateway)),
        ("runner listener", addr(&mesh.runner_gateway)),
    ]
}

async fn a_silent_connection_is_closed_and_a_busy_one_kept(runner_http2: Http2) {
    let mesh = mesh(runner_http2, None).await;
    for (what, addr) in listeners(&mesh) {
        // Nothing at all.
        let mut silent = TcpStream::connect(&addr).await.expect("connect");
        // The preface and SETTINGS (h2's handshake), no request.
        let (_idle, idle_connection) = h2_connect(&addr).await;
        // A request in time: kept past the bound.
        let (mut busy, busy_connection) = h2_connect(&addr).await;
        assert_eq!(health_check(&mut busy, &addr).await, "0", "{what}");
        assert!(
            closed_within(&mut silent, BOUND * 10).await,
            "{what}: a connection that sent nothing stays open"
        );
        let ended = tokio::time::timeout(BOUND * 10, idle_connection).await;
        assert!(
            ended.is_ok(),
            "{what}: a connection that sent no request stays open"
        );
        tokio::time::sleep(BOUND * 2).await;
        assert!(
            !busy_connection.is_finished(),
            "{what}: the busy one closed"
        );
        assert_eq!(
            health_check(&mut busy, &addr).await,
            "0",
            "{what}: served again on the same connection"
        );
    }
    mesh.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_asks_nothing_is_closed_on_every_listener() {
    a_silent_connection_is_closed_and_a_busy_one_kept(Http2::Lean).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_asks_nothing_is_closed_on_the_hyper_runner_listener() {
    a_silent_connection_is_closed_and_a_busy_one_kept(Http2::Hyper).await;
}

/// At its cap of 3 connections a listener accepts no 4th (it waits in the
/// kernel's backlog, unanswered) until one of the 3 closes; then it is
/// served. On the public gateway and the (lean) runner listener.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_its_connection_cap_a_listener_accepts_no_more_until_one_closes() {
    let mesh = mesh(Http2::Lean, Some(3)).await;
    for (what, addr) in listeners(&mesh) {
        let mut held = vec![];
        for _ in 0..3 {
            let (mut send, connection) = h2_connect(&addr).await;
            assert_eq!(health_check(&mut send, &addr).await, "0", "{what}");
            held.push((send, connection));
        }
        // The 4th: connected by the kernel, never accepted, so its HTTP/2
        // handshake gets no answer.
        let fourth = tokio::spawn({
            let addr = addr.clone();
            async move {
                let (mut send, connection) = h2_connect(&addr).await;
                let status = health_check(&mut send, &addr).await;
                (status, send, connection)
            }
        });
        tokio::time::sleep(BOUND * 2).await;
        assert!(!fourth.is_finished(), "{what}: a 4th connection was served");
        // One of the three goes: the 4th is accepted and served.
        let (send, connection) = held.pop().expect("held");
        drop(send);
        connection.abort();
        let (status, _send, _connection) = tokio::time::timeout(Duration::from_secs(20), fourth)
            .await
            .expect("served once one closed")
            .expect("the 4th");
        assert_eq!(status, "0", "{what}");
    }
    mesh.stop().await.expect("stop");
}
