//! The console's handlers against a real mesh (gRPC over loopback, SQLite),
//! driven as a browser would drive them — cookies kept, forms posted with
//! their CSRF token — with the HTML asserted and no browser.

use std::collections::HashMap;
use std::time::Duration;

use automesh_e2e_tests::{Api, Mesh};
use automesh_proto::v1 as pb;
use automesh_store::Backend;
use axum::body::Body;
use http::{Request, StatusCode, header};
use http_body_util::BodyExt;
use tower::ServiceExt;

/// A browser without a screen: the console's router, a cookie jar.
struct Browser {
    router: axum::Router,
    cookies: HashMap<String, String>,
}

struct Page {
    status: StatusCode,
    headers: http::HeaderMap,
    body: String,
}

impl Page {
    fn location(&self) -> &str {
        self.headers
            .get(header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
    }

    /// The CSRF token of the page's first form.
    fn csrf(&self) -> String {
        let at = self
            .body
            .find(r#"name="csrf" value=""#)
            .expect("a form with a CSRF token");
        let rest = &self.body[at + r#"name="csrf" value=""#.len()..];
        rest[..rest.find('"').expect("end of value")].to_owned()
    }
}

fn console_for(gateway: &str) -> automesh_console::Service {
    let config: automesh_console::Config =
        automesh_rpc::runtime::config_from_args(&["--gateway", gateway, "--gateway-timeout", "3s"])
            .expect("config");
    automesh_console::Service::new(&config).expect("console")
}

impl Browser {
    fn new(service: &automesh_console::Service) -> Self {
        Self {
            router: service.router(),
            cookies: HashMap::new(),
        }
    }

    fn request(&self, method: &str, path: &str, body: String) -> Request<Body> {
        let cookie: Vec<String> = self
            .cookies
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let mut req = Request::builder().method(method).uri(path);
        if !cookie.is_empty() {
            req = req.header(header::COOKIE, cookie.join("; "));
        }
        if method == "POST" {
            req = req.header(header::CONTENT_TYPE, "application/x-www-form-urlencoded");
        }
        req.body(Body::from(body)).expect("request")
    }

    async fn send(&mut self, req: Request<Body>) -> Page {
        let response = self.router.clone().oneshot(req).await.expect("response");
        for set in response.headers().get_all(header::SET_COOKIE) {
            let set = set.to_str().expect("ascii");
            let (pair, attrs) = set.split_once(';').unwrap_or((set, ""));
            let (k, v) = pair.split_once('=').expect("name=value");
            if attrs.contains("Max-Age=0") {
                self.cookies.remove(k);
            } else {
                self.cookies.insert(k.to_owned(), v.to_owned());
            }
        }
        let status = response.status();
        let headers = response.headers().clone();
        let bytes = tokio::time::timeout(Duration::from_secs(30), response.into_body().collect())
            .await
            .expect("a body within 30 s")
            .expect("body")
            .to_bytes();
        Page {
            status,
            headers,
            body: String::from_utf8_lossy(&bytes).into_owned(),
        }
    }

    async fn get(&mut self, path: &str) -> Page {
        let req = self.request("GET", path, String::new());
        self.send(req).await
    }

    async fn post(&mut self, path: &str, form: &[(&str, &str)]) -> Page {
        let body = form_urlencoded::Serializer::new(String::new())
            .extend_pairs(form)
            .finish();
        let req = self.request("POST", path, body);
        self.send(req).await
    }

    /// Signs in with `token` through the sign-in form.
    async fn sign_in(&mut self, token: &str) -> Page {
        let form = self.get("/sign-in").await;
        let csrf = form.csrf();
        self.post("/sign-in", &[("csrf", &csrf), ("token", token)])
            .await
    }
}

/// An automation's state, read through the API.
async fn state_of(mesh: &Mesh, token: &str, id: &str) -> i32 {
    mesh.automations(Some(token))
        .get_automation(pb::GetAutomationRequest { id: id.to_owned() })
        .await
        .expect("get")
        .into_inner()
        .automation
        .expect("automation")
        .state
}

fn daily(name: &str) -> pb::CreateAutomationRequest {
    pb::CreateAutomationRequest {
        automation: Some(pb::Automation {
            name: name.into(),
            prompt: "summarise".into(),
            model: "fake/echo".into(),
            schedule: Some(pb::Schedule {
                kind: Some(pb::schedule::Kind::Daily(pb::DailySchedule {
                    time_of_day: Some(pb::TimeOfDay {
                        hours: 9,
                        minutes: 0,
                    }),
                    time_zone: "Europe/Paris".into(),
                })),
            }),
            ..Default::default()
        }),
        surface: pb::Surface::Desktop as i32,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sign_in_keeps_the_token_in_a_strict_cookie_and_nowhere_else() {
    let mesh = Mesh::start(Backend::Sqlite).await.expect("mesh");
    let console = console_for(&mesh.gateway);
    let mut browser = Browser::new(&console);
    let token = mesh.token("acme", "alice");

    let first = browser.get("/").await;
    assert_eq!(first.status, StatusCode::SEE_OTHER);
    assert_eq!(first.location(), "/sign-in");
    let csp = first.headers[header::CONTENT_SECURITY_POLICY]
        .to_str()
        .expect("csp");
    assert!(
        csp.contains("script-src 'self'") && !csp.contains("unsafe-inline"),
        "{csp}"
    );

    // A sign-in without the form's CSRF token is refused.
    let forged = browser
        .post("/sign-in", &[("csrf", "nope"), ("token", &token)])
        .await;
    assert_eq!(forged.status, StatusCode::FORBIDDEN);
    assert!(!browser.cookies.contains_key("automesh_session"));

    // A bad token is refused on the sign-in page itself.
    let bad = browser.sign_in("not-a-jwt").await;
    assert_eq!(bad.status, StatusCode::UNAUTHORIZED);
    assert!(bad.body.contains("That token was refused"), "{}", bad.body);

    let signed = browser.sign_in(&token).await;
    assert_eq!(signed.status, StatusCode::SEE_OTHER, "{}", signed.body);
    let set: Vec<&str> = signed
        .headers
        .get_all(header::SET_COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .filter(|v| v.starts_with("automesh_session="))
        .collect();
    assert_eq!(set.len(), 1);
    for attr in ["HttpOnly", "SameSite=Strict", "Path=/"] {
        assert!(set[0].contains(attr), "{}", set[0]);
    }
    assert!(!signed.location().contains(&token));

    let list = browser.get("/").await;
    assert_eq!(list.status, StatusCode::OK);
    assert!(list.body.contains("<h1>Automations</h1>"));
    assert!(!list.body.contains(&token), "the token is in the page");

    // Sign-out needs the session's CSRF token, then clears the cookie.
    let refused = browser.post("/sign-out", &[("csrf", "forged")]).await;
    assert_eq!(refused.status, StatusCode::FORBIDDEN);
    let out = browser.post("/sign-out", &[("csrf", &list.csrf())]).await;
    assert_eq!(out.location(), "/sign-in?ended=out");
    assert!(!browser.cookies.contains_key("automesh_session"));
    assert_eq!(browser.get("/").await.location(), "/sign-in");
    mesh.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_token_sends_the_user_to_sign_in_with_a_reason() {
    let mesh = Mesh::start(Backend::Sqlite).await.expect("mesh");
    let console = console_for(&mesh.gateway);
    let mut browser = Browser::new(&console);
    let expired = automesh_gateway::mint(
        automesh_e2e_tests::JWT_SECRET,
        "acme",
        "alice",
        chrono::Duration::hours(-1),
    )
    .expect("mint");
    browser.cookies.insert("automesh_session".into(), expired);
    let page = browser.get("/").await;
    assert_eq!(page.status, StatusCode::SEE_OTHER);
    assert_eq!(page.location(), "/sign-in?ended=expired");
    assert!(
        !browser.cookies.contains_key("automesh_session"),
        "the cookie is cleared"
    );
    let sign_in = browser.get(page.location()).await;
    assert!(
        sign_in.body.contains("Your session has expired"),
        "{}",
        sign_in.body
    );
    mesh.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forms_without_the_sessions_csrf_token_change_nothing() {
    let mesh = Mesh::start(Backend::Sqlite).await.expect("mesh");
    let console = console_for(&mesh.gateway);
    let token = mesh.token("acme", "alice");
    let a = mesh.automations(Some(&token)).create(daily("kept")).await;
    let mut browser = Browser::new(&console);
    browser.sign_in(&token).await;
    // Another session's token, or none, is refused.
    let mut other = Browser::new(&console);
    other.sign_in(&mesh.token("acme", "bob")).await;
    let bobs = other.get("/").await.csrf();
    for csrf in ["", "0000", bobs.as_str()] {
        let bulk = browser
            .post(
                "/automations/bulk",
                &[("csrf", csrf), ("ids", &a.id), ("action", "pause")],
            )
            .await;
        assert_eq!(bulk.status, StatusCode::FORBIDDEN, "{csrf:?}");
        let archive = browser
            .post(&format!("/automations/{}/archive", a.id), &[("csrf", csrf)])
            .await;
        assert_eq!(archive.status, StatusCode::FORBIDDEN);
    }
    assert_eq!(
        state_of(&mesh, &token, &a.id).await,
        pb::AutomationState::Active as i32
    );
    mesh.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_users_ids_are_the_unknown_ids_404() {
    let mesh = Mesh::start(Backend::Sqlite).await.expect("mesh");
    let console = console_for(&mesh.gateway);
    let alice = mesh.token("acme", "alice");
    let a = mesh
        .automations(Some(&alice))
        .create(daily("alice's"))
        .await;
    let run = mesh.automations(Some(&alice)).run_now(&a.id, "k").await;
    let mut eve = Browser::new(&console);
    eve.sign_in(&mesh.token("acme", "eve")).await;
    let unknown = eve.get("/automations/no-such-id").await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
    for path in [
        format!("/automations/{}", a.id),
        format!("/automations/{}/edit", a.id),
        format!("/runs/{}", run.id),
    ] {
        let page = eve.get(&path).await;
        assert_eq!(page.status, StatusCode::NOT_FOUND, "{path}");
        assert_eq!(
            page.body, unknown.body,
            "{path} tells more than an unknown id"
        );
    }
    mesh.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untrusted_text_is_escaped_on_every_page() {
    let mesh = Mesh::start(Backend::Sqlite).await.expect("mesh");
    let console = console_for(&mesh.gateway);
    let token = mesh.token("acme", "alice");
    let evil = r#"<script>alert(1)</script><img src=x onerror=alert(2)>"#;
    let mut req = daily(evil);
    if let Some(a) = req.automation.as_mut() {
        a.prompt = format!("{evil} javascript:alert(3)");
    }
    let a = mesh.automations(Some(&token)).create(req).await;
    let mut browser = Browser::new(&console);
    browser.sign_in(&token).await;
    for path in [
        "/".to_owned(),
        format!("/automations/{}", a.id),
        format!("/automations/{}/edit", a.id),
    ] {
        let page = browser.get(&path).await;
        assert_eq!(page.status, StatusCode::OK, "{path}");
        assert!(
            !page.body.contains("<script>alert"),
            "{path}: {}",
            page.body
        );
        assert!(!page.body.contains("<img src=x"), "{path}");
        assert!(
            page.body.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
            "{path}"
        );
    }
    mesh.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_s_field_errors_appear_next_to_their_fields() {
    let mesh = Mesh::start(Backend::Sqlite).await.expect("mesh");
    let console = console_for(&mesh.gateway);
    let mut browser = Browser::new(&console);
    browser.sign_in(&mesh.token("acme", "alice")).await;
    let csrf = browser.get("/automations/new").await.csrf();
    let page = browser
        .post(
            "/automations",
            &[
                ("csrf", &csrf),
                ("name", "x"),
                ("prompt", "p"),
                ("model", "no/such-model"),
                ("kind", "weekly"),
                ("time", "09:30"),
                ("zone", "Mars/Olympus_Mons"),
            ],
        )
        .await;
    assert_eq!(page.status, StatusCode::BAD_REQUEST);
    // The gateway's violations, each beside its field.
    for field in ["zone-error", "days-error"] {
        assert!(
            page.body.contains(&format!(r#"id="{field}""#)),
            "{field} missing"
        );
    }
    // What was typed is kept.
    assert!(page.body.contains("no/such-model"));
    // With the schedule right, the model is checked, and named beside its field.
    let page = browser
        .post(
            "/automations",
            &[
                ("csrf", &csrf),
                ("name", "x"),
                ("prompt", "p"),
                ("model", "no/such-model"),
                ("kind", "weekly"),
                ("days", "2"),
                ("time", "09:30"),
                ("zone", "Europe/Paris"),
            ],
        )
        .await;
    assert_eq!(page.status, StatusCode::BAD_REQUEST);
    assert!(
        page.body.contains(r#"id="model-error""#),
        "model-error missing"
    );
    // A time the console cannot read is named before any call.
    let page = browser
        .post(
            "/automations",
            &[
                ("csrf", &csrf),
                ("name", "x"),
                ("prompt", "p"),
                ("model", "fake/echo"),
                ("kind", "daily"),
                ("time", "25"),
                ("zone", "UTC"),
            ],
        )
        .await;
    assert!(
        page.body.contains(r#"id="time-error""#),
        "time-error missing"
    );
    mesh.stop().await.expect("stop");
}

/// The failure streak that pauses an automation and its budget per run
/// (issue 32) are set on the form (a bad value named beside its field),
/// kept or cleared by an edit, and shown on the automation's page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_failure_streak_that_pauses_an_automation_is_set_and_shown() {
    let mesh = Mesh::start(Backend::Sqlite).await.expect("mesh");
    let console = console_for(&mesh.gateway);
    let mut browser = Browser::new(&console);
    let token = mesh.token("acme", "alice");
    browser.sign_in(&token).await;
    let csrf = browser.get("/automations/new").await.csrf();
    let form = |pause: &'static str| {
        vec![
            ("name", "streaky"),
            ("prompt", "p"),
            ("model", "fake/echo"),
            ("kind", "daily"),
            ("time", "09:30"),
            ("zone", "Europe/Paris"),
            ("pause_after_failures", pause),
        ]
    };
    for bad in ["-1", "many"] {
        let mut fields = form(bad);
        fields.push(("csrf", &csrf));
        let page = browser.post("/automations", &fields).await;
        assert_eq!(page.status, StatusCode::BAD_REQUEST, "{bad}");
        assert!(
            page.body.contains(r#"id="pause_after_failures-error""#),
            "{bad}: no error beside the field"
        );
    }
    // (A web automation needs a cloud worker; a desktop one is shown alike.)
    let mut request = daily("streaky");
    if let Some(a) = request.automation.as_mut() {
        a.pause_after_failures = Some(5);
        a.max_tokens = Some(777);
        a.monthly_budget_micros = Some(9_000);
    }
    let created = mesh.automations(Some(&token)).create(request).await;
    let at = format!("/automations/{}", created.id);
    let page = browser.get(&at).await;
    assert!(
        page.body.contains(r#"id="failure-streak""#),
        "{}",
        page.body
    );
    assert!(page.body.contains("pauses after 5"), "{}", page.body);
    assert!(
        page.body.contains("777 tokens"),
        "the budget per run is shown"
    );
    assert!(
        page.body.contains("9000 µ, 0 µ spent this month"),
        "{}",
        page.body
    );
    // The edit form shows it, and saving it again keeps it.
    let id = at.trim_start_matches("/automations/");
    let edit = browser.get(&format!("{at}/edit")).await;
    assert!(edit.body.contains(r#"name="pause_after_failures""#));
    assert!(edit.body.contains(r#"value="5""#));
    let etag = mesh
        .automations(Some(&token))
        .get_automation(pb::GetAutomationRequest { id: id.to_owned() })
        .await
        .expect("get")
        .into_inner()
        .automation
        .expect("automation")
        .etag;
    // A cap the console cannot read is named beside its field.
    let mut fields = form("0");
    fields.push(("csrf", &csrf));
    fields.push(("etag", &etag));
    fields.push(("max_cost_micros", "lots"));
    let refused = browser.post(&format!("{at}/edit"), &fields).await;
    assert!(refused.body.contains(r#"id="max_cost_micros-error""#));
    // Saved with a cost cap and the token cap's field left blank: set and
    // removed.
    fields.pop();
    fields.push(("max_cost_micros", "1500"));
    let saved = browser.post(&format!("{at}/edit"), &fields).await;
    assert_eq!(saved.status, StatusCode::SEE_OTHER, "{}", saved.body);
    let page = browser.get(&at).await;
    assert!(
        page.body.contains("never pauses by itself"),
        "{}",
        page.body
    );
    assert!(page.body.contains("1500 µ"), "{}", page.body);
    assert!(
        !page.body.contains("777 tokens"),
        "the token cap was removed"
    );
    mesh.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_preview_lists_occurrences_in_the_zone_and_in_utc_across_dst() {
    let mesh = Mesh::start(Backend::Sqlite).await.expect("mesh");
    let console = console_for(&mesh.gateway);
    let mut browser = Browser::new(&console);
    browser.sign_in(&mesh.token("acme", "alice")).await;
    let page = browser
        .get("/preview?kind=weekly&time=09%3A30&zone=America%2FNew_York&days=1&days=4")
        .await;
    assert_eq!(page.status, StatusCode::OK);
    assert_eq!(
        page.body.matches("<tr><td>").count(),
        6,
        "5 + 1 across DST: {}",
        page.body
    );
    assert!(page.body.contains("In America/New_York") && page.body.contains(" UTC</time>"));
    assert!(page.body.contains("offset changes"), "{}", page.body);
    let bad = browser
        .get("/preview?kind=daily&time=09%3A30&zone=Nowhere")
        .await;
    assert!(bad.body.contains("No preview"), "{}", bad.body);
    mesh.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_pause_answers_for_each_automation() {
    let mesh = Mesh::start(Backend::Sqlite).await.expect("mesh");
    let console = console_for(&mesh.gateway);
    let token = mesh.token("acme", "alice");
    let mut api = mesh.automations(Some(&token));
    let a = api.create(daily("a")).await;
    let b = api.create(daily("b")).await;
    let archived = api.create(daily("archived")).await;
    api.archive_automation(pb::ArchiveAutomationRequest {
        id: archived.id.clone(),
        etag: String::new(),
    })
    .await
    .expect("archive");
    let mut browser = Browser::new(&console);
    browser.sign_in(&token).await;
    let csrf = browser.get("/").await.csrf();
    let done = browser
        .post(
            "/automations/bulk",
            &[
                ("csrf", &csrf),
                ("action", "pause"),
                ("ids", &a.id),
                ("ids", &b.id),
                ("ids", &archived.id),
            ],
        )
        .await;
    assert_eq!(done.status, StatusCode::SEE_OTHER);
    let list = browser.get(done.location()).await;
    assert!(list.body.contains("Paused 2."), "{}", list.body);
    assert!(
        list.body.contains("1 could not be changed"),
        "{}",
        list.body
    );
    for id in [&a.id, &b.id] {
        assert_eq!(
            state_of(&mesh, &token, id).await,
            pb::AutomationState::Inactive as i32
        );
    }
    mesh.stop().await.expect("stop");
}

/// Reads SSE frames from `body` until `items` thread events have arrived
/// (bounded), returning their ids and the event names seen.
async fn read_items(body: Body, items: usize) -> (Vec<i64>, Vec<String>) {
    let mut stream = body.into_data_stream();
    let (mut ids, mut names, mut text) = (vec![], vec![], String::new());
    use futures_util::StreamExt;
    while ids.len() < items {
        let chunk = tokio::time::timeout(Duration::from_secs(20), stream.next())
            .await
            .expect("an event within 20 s")
            .expect("the stream is open")
            .expect("bytes");
        text.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = text.find("\n\n") {
            let frame: String = text.drain(..end + 2).collect();
            let field = |name: &str| {
                frame
                    .lines()
                    .find_map(|l| {
                        l.strip_prefix(&format!("{name}: "))
                            .or_else(|| l.strip_prefix(&format!("{name}:")))
                    })
                    .map(str::to_owned)
            };
            if let Some(event) = field("event") {
                if event == "item" {
                    ids.push(
                        field("id")
                            .expect("an item has an id")
                            .parse()
                            .expect("a sequence"),
                    );
                }
                names.push(event);
            }
        }
    }
    (ids, names)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_page_resumes_after_the_last_event_id_without_gaps_or_repeats() {
    use automesh_domain::RunEventPayload;
    use automesh_store::events::NewEvent;
    let mesh = Mesh::start(Backend::Sqlite).await.expect("mesh");
    let console = console_for(&mesh.gateway);
    let token = mesh.token("acme", "alice");
    // A desktop run with no runner stays pending: its events are ours to add.
    let a = mesh.automations(Some(&token)).create(daily("live")).await;
    let run = mesh.automations(Some(&token)).run_now(&a.id, "live").await;
    let text = |i: usize| NewEvent {
        event_id: format!("e{i}"),
        payload: RunEventPayload::AssistantText {
            text: format!("<b>text {i}</b>"),
        },
    };
    let append = |from: usize, to: usize| {
        let events: Vec<NewEvent> = (from..=to).map(text).collect();
        let (store, id) = (mesh.store().clone(), run.id.clone());
        async move {
            store
                .append_events(&id, &events, chrono::Utc::now())
                .await
                .expect("append")
        }
    };
    append(1, 5).await;
    let mut browser = Browser::new(&console);
    browser.sign_in(&token).await;
    let page = browser.get(&format!("/runs/{}", run.id)).await;
    assert!(
        page.body.contains("&lt;b&gt;text 1&lt;/b&gt;"),
        "{}",
        page.body
    );
    assert!(page.body.contains(r#"data-live="true""#));

    // The browser lost its connection after sequence 2: it resumes there.
    let mut req = browser.request("GET", &format!("/runs/{}/events", run.id), String::new());
    req.headers_mut()
        .insert("last-event-id", "2".parse().expect("header"));
    let response = browser.router.clone().oneshot(req).await.expect("response");
    assert_eq!(
        response.headers()[header::CONTENT_TYPE],
        "text/event-stream"
    );
    let (ids, names) = read_items(response.into_body(), 3).await;
    assert_eq!(ids, [3, 4, 5]);
    assert!(
        names.contains(&"run".to_owned()),
        "the run's summary comes first: {names:?}"
    );
    assert_eq!(
        automesh_console::live_pages(),
        0,
        "a dropped page stops counting"
    );

    // More arrives while nobody watches; the next resume gets exactly it.
    append(6, 7).await;
    let mut req = browser.request(
        "GET",
        &format!("/runs/{}/events?after=1", run.id),
        String::new(),
    );
    req.headers_mut()
        .insert("last-event-id", "5".parse().expect("header"));
    let response = browser.router.clone().oneshot(req).await.expect("response");
    let (ids, _) = read_items(response.into_body(), 2).await;
    assert_eq!(
        ids,
        [6, 7],
        "Last-Event-ID wins over the page's starting point"
    );
    mesh.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_the_gateway_is_down_pages_say_so_and_retry() {
    // A port nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = format!("http://{}", closed.local_addr().expect("addr"));
    drop(closed);
    let console = console_for(&addr);
    let mut browser = Browser::new(&console);
    browser
        .cookies
        .insert("automesh_session".into(), "some.token.value".into());
    let page = browser.get("/").await;
    assert_eq!(page.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(page.body.contains("The API gateway is not answering"));
    assert!(page.body.contains(r#"http-equiv="refresh""#));
    assert_eq!(
        browser.get("/readyz").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(browser.get("/healthz").await.status, StatusCode::OK);
    // A live page is told to reconnect by itself.
    let events = browser.get("/runs/r1/events").await;
    assert!(events.body.contains("retry: 2000"), "{}", events.body);
    assert!(events.body.contains("event: gone"), "{}", events.body);
}

/// Issue 32: the owner registers a webhook endpoint from the console (its
/// secret shown once, never again), sends it a test message that arrives
/// signed, sees what delivery did, and deletes it; another user's endpoint
/// is the unknown id's 404; a bad URL is refused next to its field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_endpoints_are_managed_from_the_console() {
    use automesh_e2e_tests::webhooks::{Answer, Receiver, verify_with_python};
    let mesh = Mesh::start(Backend::Sqlite).await.expect("mesh");
    let console = console_for(&mesh.gateway);
    let receiver = Receiver::start(Answer::Status(204))
        .await
        .expect("receiver");
    let mut alice = Browser::new(&console);
    alice.sign_in(&mesh.token("acme", "alice")).await;
    let page = alice.get("/webhooks").await;
    assert_eq!(page.status, StatusCode::OK);
    assert!(page.body.contains("No endpoints yet."));
    let csrf = page.csrf();
    let refused = alice
        .post(
            "/webhooks",
            &[("csrf", &csrf), ("url", "hooks.example.com/x")],
        )
        .await;
    assert_eq!(refused.status, StatusCode::SEE_OTHER);
    let shown = alice.get(refused.location()).await;
    assert!(shown.body.contains("not an absolute URL"), "{}", shown.body);
    let created = alice
        .post(
            "/webhooks",
            &[
                ("csrf", &csrf),
                ("url", &receiver.url),
                ("description", "pager <b>"),
            ],
        )
        .await;
    assert_eq!(created.status, StatusCode::OK);
    let between = |body: &str, id: &str| {
        let at = body.find(&format!(r#"id="{id}">"#)).expect(id) + id.len() + 6;
        body[at..at + body[at..].find('<').expect("end")].to_owned()
    };
    let secret = between(&created.body, "created-secret");
    let endpoint = between(&created.body, "created-endpoint");
    assert!(secret.starts_with("whsec_") && endpoint.starts_with("ep_"));
    let listed = alice.get("/webhooks").await;
    assert!(listed.body.contains(&endpoint) && listed.body.contains(&receiver.url));
    assert!(listed.body.contains("pager &lt;b&gt;"), "escaped");
    assert!(!listed.body.contains(&secret), "shown once");
    let tested = alice
        .post(&format!("/webhooks/{endpoint}/test"), &[("csrf", &csrf)])
        .await;
    assert_eq!(tested.status, StatusCode::SEE_OTHER);
    let give_up = tokio::time::Instant::now() + Duration::from_secs(30);
    while receiver.delivered().is_empty() {
        assert!(
            tokio::time::Instant::now() < give_up,
            "the test message never came"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    verify_with_python(&secret, &receiver.received()).expect("signed");
    let messages = alice.get(&format!("/webhooks/{endpoint}")).await;
    assert!(messages.body.contains("webhook.test") && messages.body.contains("delivered"));

    let mut eve = Browser::new(&console);
    eve.sign_in(&mesh.token("acme", "eve")).await;
    let unknown = eve.get("/webhooks/ep_unknown").await;
    let theirs = eve.get(&format!("/webhooks/{endpoint}")).await;
    assert_eq!(theirs.status, StatusCode::NOT_FOUND);
    assert_eq!(theirs.body, unknown.body);
    let eves = eve.get("/webhooks").await;
    assert!(!eves.body.contains(&endpoint));

    let deleted = alice
        .post(&format!("/webhooks/{endpoint}/delete"), &[("csrf", &csrf)])
        .await;
    assert_eq!(deleted.status, StatusCode::SEE_OTHER);
    assert!(
        alice
            .get("/webhooks")
            .await
            .body
            .contains("No endpoints yet.")
    );
    mesh.stop().await.expect("stop");
}
