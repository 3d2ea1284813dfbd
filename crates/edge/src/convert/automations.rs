//! Automations, and the validation of the requests that carry them.

use automesh_domain::RunBudget;
use automesh_domain::automation::{
    AutomationPatch, DEFAULT_PAUSE_AFTER_FAILURES, IDEMPOTENCY_KEY_LIMIT, check_budget,
    check_fields, check_pause_after_failures, parse_etag,
};
use automesh_domain::{Automation, Placement, Schedule, Surface, Violations};
use automesh_proto::v1 as pb;
use chrono::{DateTime, Utc};

#[allow(unused_imports)]
use super::*;

pub fn automation_to_pb(a: &Automation) -> pb::Automation {
    pb::Automation {
        id: a.id.clone(),
        organization_id: a.org_id.clone(),
        owner_id: a.owner_id.clone(),
        name: a.name.clone(),
        prompt: a.prompt.clone(),
        model: a.model.clone(),
        placement: placement_to_pb(a.placement) as i32,
        schedule: Some(schedule_to_pb(&a.schedule)),
        state: automation_state_to_pb(a.state) as i32,
        attention_reason: code_name(a.attention.as_ref().map(|x| x.reason)),
        attention_message: a
            .attention
            .as_ref()
            .map(|x| x.message.clone())
            .unwrap_or_default(),
        etag: a.etag(),
        next_run_time: a.next_run_at.map(timestamp),
        create_time: Some(timestamp(a.created_at)),
        update_time: Some(timestamp(a.updated_at)),
        surface: surface_to_pb(a.surface) as i32,
        pause_reason: a.pause_reason.clone().unwrap_or_default(),
        last_run: None,
        pause_after_failures: Some(a.pause_after_failures as i32),
        failure_streak: a.failure_streak.runs,
        failure_streak_codes: a.failure_streak.codes.clone(),
        max_cost_micros: a.budget.max_cost_micros,
        max_tokens: a.budget.max_tokens,
        monthly_budget_micros: a.monthly_budget_micros,
        month_spend_micros: None,
    }
}

/// A validated creation request, before the model and the owner's cloud
/// worker are checked against the catalogue and the lifecycle service.
#[derive(Debug, Clone, PartialEq)]
pub struct CreateInput {
    pub name: String,
    pub prompt: String,
    pub model: String,
    pub surface: Surface,
    pub schedule: Schedule,
    pub pause_after_failures: u32,
    pub budget: RunBudget,
    pub monthly_budget_micros: Option<i64>,
}

impl CreateInput {
    pub fn placement(&self) -> Placement {
        self.surface.placement()
    }
}

/// Validates `CreateAutomation`'s automation and surface.
pub fn parse_create(
    automation: Option<&pb::Automation>,
    surface: i32,
    now: DateTime<Utc>,
) -> Result<CreateInput, Violations> {
    let mut v = Violations::default();
    let surface = surface_from_pb(surface);
    if surface.is_none() {
        v.field(
            "surface",
            "required: one of SURFACE_DESKTOP, SURFACE_WEB, SURFACE_CLOUD_CHAT",
        );
    }
    let Some(a) = automation else {
        v.field("automation", "required");
        return Err(v);
    };
    check_fields(
        &mut v,
        "automation",
        Some(&a.name),
        Some(&a.prompt),
        Some(&a.model),
    );
    if let (Some(surface), Some(claimed)) = (surface, placement_from_pb(a.placement))
        && claimed != surface.placement()
    {
        v.field(
            "automation.placement",
            format!(
                "placement is decided by the creating surface ({}), which places it {}",
                surface,
                surface.placement()
            ),
        );
    }
    let schedule = schedule_from_pb(a.schedule.as_ref(), "automation.schedule", now, &mut v);
    let pause_after_failures = match a.pause_after_failures {
        None => Some(DEFAULT_PAUSE_AFTER_FAILURES),
        Some(n) => {
            check_pause_after_failures(&mut v, "automation.pause_after_failures", i64::from(n))
        }
    };
    let budget = RunBudget {
        max_cost_micros: check_budget(&mut v, "automation.max_cost_micros", a.max_cost_micros),
        max_tokens: check_budget(&mut v, "automation.max_tokens", a.max_tokens),
    };
    let monthly_budget_micros = check_budget(
        &mut v,
        "automation.monthly_budget_micros",
        a.monthly_budget_micros,
    );
    match (surface, schedule, pause_after_failures) {
        (Some(surface), Some(schedule), Some(pause_after_failures)) if v.is_empty() => {
            Ok(CreateInput {
                name: a.name.trim().to_owned(),
                prompt: a.prompt.clone(),
                model: a.model.trim().to_owned(),
                surface,
                schedule,
                pause_after_failures,
                budget,
                monthly_budget_micros,
            })
        }
        _ => Err(v),
    }
}

/// The fields `UpdateAutomation` changes when its mask is empty.
pub const UPDATABLE_PATHS: &[&str] = &["name", "prompt", "model", "schedule"];

/// A validated update: the automation id, the patch, and a placement the
/// client claimed (which must equal the stored one).
#[derive(Debug, Clone, PartialEq)]
pub struct UpdateInput {
    pub id: String,
    pub patch: AutomationPatch,
    pub claimed_placement: Option<Placement>,
}

/// Validates `UpdateAutomation`.
pub fn parse_update(
    req: &pb::UpdateAutomationRequest,
    now: DateTime<Utc>,
) -> Result<UpdateInput, Violations> {
    let mut v = Violations::default();
    let Some(a) = req.automation.as_ref() else {
        v.field("automation", "required");
        return Err(v);
    };
    if a.id.is_empty() {
        v.field("automation.id", "required");
    }
    automesh_domain::validation::check_no_nul(&mut v, "automation.id", &a.id);
    let paths: Vec<&str> = match &req.update_mask {
        Some(mask) if !mask.paths.is_empty() => mask.paths.iter().map(String::as_str).collect(),
        _ => UPDATABLE_PATHS.to_vec(),
    };
    let mut patch = AutomationPatch::default();
    for path in &paths {
        match *path {
            "name" => patch.name = Some(a.name.trim().to_owned()),
            "prompt" => patch.prompt = Some(a.prompt.clone()),
            "model" => patch.model = Some(a.model.trim().to_owned()),
            "schedule" => {
                patch.schedule =
                    schedule_from_pb(a.schedule.as_ref(), "automation.schedule", now, &mut v)
            }
            "pause_after_failures" => {
                patch.pause_after_failures = match a.pause_after_failures {
                    Some(n) => check_pause_after_failures(
                        &mut v,
                        "automation.pause_after_failures",
                        i64::from(n),
                    ),
                    None => {
                        v.field(
                            "automation.pause_after_failures",
                            "required when update_mask names it: 0 (never pause) or more",
                        );
                        None
                    }
                }
            }
            "max_cost_micros" => {
                patch.max_cost_micros = Some(check_budget(
                    &mut v,
                    "automation.max_cost_micros",
                    a.max_cost_micros,
                ))
            }
            "max_tokens" => {
                patch.max_tokens = Some(check_budget(&mut v, "automation.max_tokens", a.max_tokens))
            }
            "monthly_budget_micros" => {
                patch.monthly_budget_micros = Some(check_budget(
                    &mut v,
                    "automation.monthly_budget_micros",
                    a.monthly_budget_micros,
                ))
            }
            "placement" => v.field(
                "update_mask",
                "placement cannot be changed: create a new automation from the other surface",
            ),
            other => v.field(
                "update_mask",
                format!(
                    "unknown or read-only field {other:?}; updatable: name, prompt, model, schedule, pause_after_failures, max_cost_micros, max_tokens, monthly_budget_micros"
                ),
            ),
        }
    }
    check_fields(
        &mut v,
        "automation",
        patch.name.as_deref(),
        patch.prompt.as_deref(),
        patch.model.as_deref(),
    );
    if !a.etag.is_empty() {
        match parse_etag(&a.etag) {
            Some(version) => patch.expected_version = Some(version),
            None => v.field("automation.etag", "not an etag issued by this service"),
        }
    }
    v.into_result(UpdateInput {
        id: a.id.clone(),
        patch,
        claimed_placement: placement_from_pb(a.placement),
    })
}

/// Validates an optional etag of a state-change request.
pub fn parse_optional_etag(etag: &str, field: &str) -> Result<Option<i64>, Violations> {
    if etag.is_empty() {
        return Ok(None);
    }
    let mut v = Violations::default();
    let version = parse_etag(etag);
    if version.is_none() {
        v.field(field, "not an etag issued by this service");
    }
    v.into_result(version)
}

/// A reason given when pausing: optional (empty is none), at most 500
/// characters, no NUL.
pub fn parse_pause_reason<'a>(reason: &'a str, field: &str) -> Result<Option<&'a str>, Violations> {
    if reason.trim().is_empty() {
        return Ok(None);
    }
    let mut v = Violations::default();
    automesh_domain::validation::check_text(
        &mut v,
        field,
        reason,
        automesh_domain::automation::PAUSE_REASON_LIMIT,
    );
    v.into_result(Some(reason))
}

/// The ids of a batch: 1..=`max` distinct ids, each a valid id.
pub fn require_ids(ids: &[String], field: &str, max: usize) -> Result<(), Violations> {
    let mut v = Violations::default();
    if ids.is_empty() {
        v.field(field, "required: at least one id");
    } else if ids.len() > max {
        v.field(field, format!("at most {max} ids"));
    }
    let mut seen = std::collections::HashSet::new();
    for (i, id) in ids.iter().enumerate() {
        let path = format!("{field}[{i}]");
        if let Err(e) = require_id(id, &path) {
            e.iter().cloned().for_each(|x| v.push(x));
        } else if !seen.insert(id.as_str()) {
            v.field(&path, "repeats an earlier id");
        }
    }
    v.into_result(())
}

/// Validates a required id field.
pub fn require_id(id: &str, field: &str) -> Result<(), Violations> {
    let mut v = Violations::default();
    if id.is_empty() {
        v.field(field, "required");
    } else if id.len() > 200 {
        v.field(field, "must be at most 200 bytes");
    }
    automesh_domain::validation::check_no_nul(&mut v, field, id);
    v.into_result(())
}

/// A sequence number a client sends back (where a read goes on): never
/// negative.
pub fn not_negative(sequence: i64, field: &str) -> Result<(), Violations> {
    let mut v = Violations::default();
    if sequence < 0 {
        v.field(field, "must not be negative");
    }
    v.into_result(())
}

/// Validates optional text fields that reach the database as they are
/// (filters, page tokens): no NUL.
pub fn check_optional_text(fields: &[(&str, &str)]) -> Result<(), Violations> {
    let mut v = Violations::default();
    for (field, value) in fields {
        automesh_domain::validation::check_no_nul(&mut v, field, value);
    }
    v.into_result(())
}

/// Validates `RunAutomationNow`.
pub fn parse_run_now(req: &pb::RunAutomationNowRequest) -> Result<(), Violations> {
    let mut v = Violations::default();
    if req.id.is_empty() {
        v.field("id", "required");
    }
    automesh_domain::validation::check_no_nul(&mut v, "id", &req.id);
    if req.idempotency_key.trim().is_empty() {
        v.field(
            "idempotency_key",
            "required: the same key returns the same run",
        );
    } else {
        automesh_domain::validation::check_text(
            &mut v,
            "idempotency_key",
            &req.idempotency_key,
            IDEMPOTENCY_KEY_LIMIT,
        );
    }
    v.into_result(())
}

/// Validates a page size: negative is an error, 0 is `default`, more than
/// [`MAX_PAGE_SIZE`] is capped.
pub fn page_size(size: i32, default: u32, field: &str) -> Result<u32, Violations> {
    let mut v = Violations::default();
    if size < 0 {
        v.field(field, "must not be negative");
    }
    v.into_result(match size {
        0 => default,
        n => (n as u32).min(MAX_PAGE_SIZE),
    })
}
