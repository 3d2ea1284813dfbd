//! The model catalogue: which model ids exist, which organisations they are
//! authorised for, the name each provider is asked for, and each model's
//! price. Creation rejects an unknown model as bad input and an unauthorised
//! one (for cloud placement) as a failed precondition; the run-coordinator
//! prices every run from it.
//!
//! ```json
//! {"models": [{"id": "openai/gpt-4.1-mini",
//!              "provider_model": "gpt-4.1-mini",
//!              "price": {"input_micros_per_million_tokens": 400000,
//!                        "output_micros_per_million_tokens": 1600000},
//!              "authorized_orgs": ["*"]}]}
//! ```

use serde::{Deserialize, Serialize};

/// A model's price: millionths of the billing currency unit per million
/// tokens, for input (prompt) and output (completion) tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    pub input_micros_per_million_tokens: i64,
    pub output_micros_per_million_tokens: i64,
}

impl Price {
    /// What `input` and `output` tokens cost, in micro-units, rounded up to
    /// the next micro-unit (never negative, saturating instead of wrapping).
    pub fn cost_micros(&self, input: i64, output: i64) -> i64 {
        let raw = i128::from(input.max(0)) * i128::from(self.input_micros_per_million_tokens)
            + i128::from(output.max(0)) * i128::from(self.output_micros_per_million_tokens);
        let micros = (raw.max(0) + 999_999) / 1_000_000;
        i64::try_from(micros).unwrap_or(i64::MAX)
    }
}

/// One model the mesh can run.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// The id users pick, `<provider>/<model>`, such as `openai/gpt-4.1-mini`.
    pub id: String,
    /// Organisations the model is authorised for; `*` means every one.
    #[serde(default = "all_orgs")]
    pub authorized_orgs: Vec<String>,
    /// The model name the provider expects (the `model` of an
    /// OpenAI-compatible request; OpenCode's `modelID`). Without it, the id
    /// after its first `/`: `openai/gpt-4.1-mini` asks for `gpt-4.1-mini`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_model: Option<String>,
    /// The price runs of this model are charged at. Without one, runs of the
    /// model are unpriced: their cost is 0 and their receipts carry no price.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub price: Option<Price>,
}

fn all_orgs() -> Vec<String> {
    vec!["*".to_owned()]
}

impl ModelSpec {
    /// A model every organisation may use, without a price.
    pub fn new(id: &str) -> Self {
        ModelSpec {
            id: id.to_owned(),
            authorized_orgs: all_orgs(),
            provider_model: None,
            price: None,
        }
    }

    /// The same model at `price`.
    pub fn priced(mut self, input: i64, output: i64) -> Self {
        self.price = Some(Price {
            input_micros_per_million_tokens: input,
            output_micros_per_million_tokens: output,
        });
        self
    }

    /// The name the provider is asked for.
    pub fn provider_model(&self) -> &str {
        match &self.provider_model {
            Some(name) if !name.is_empty() => name,
            _ => self
                .id
                .split_once('/')
                .map_or(self.id.as_str(), |(_, model)| model),
        }
    }
}

/// The models known to the mesh.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ModelCatalog {
    pub models: Vec<ModelSpec>,
}

impl ModelCatalog {
    /// The catalogue used when none is configured (`dev`, tests): two
    /// OpenAI models at their list prices in USD micro-units, and an
    /// unpriced `fake/echo`.
    pub fn development() -> Self {
        Self {
            models: vec![
                ModelSpec::new("openai/gpt-4.1-mini").priced(400_000, 1_600_000),
                ModelSpec::new("openai/gpt-4.1").priced(2_000_000, 8_000_000),
                ModelSpec::new("fake/echo"),
            ],
        }
    }

    /// Reads a catalogue from its JSON form (`{"models": [...]}`) and checks
    /// it: ids unique and non-empty, prices not negative.
    pub fn from_json(json: &str) -> Result<Self, String> {
        let catalog: ModelCatalog = serde_json::from_str(json).map_err(|e| e.to_string())?;
        let mut seen = std::collections::HashSet::new();
        for m in &catalog.models {
            if m.id.trim().is_empty() {
                return Err("a model has an empty id".into());
            }
            if !seen.insert(m.id.as_str()) {
                return Err(format!("model {:?} is listed twice", m.id));
            }
            if let Some(p) = m.price
                && (p.input_micros_per_million_tokens < 0 || p.output_micros_per_million_tokens < 0)
            {
                return Err(format!("model {:?} has a negative price", m.id));
            }
        }
        Ok(catalog)
    }

    /// Reads the catalogue at `path`, or the development one without a path.
    pub fn load(path: Option<&std::path::Path>) -> Result<Self, String> {
        match path {
            None => Ok(Self::development()),
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .map_err(|e| format!("cannot read model catalogue {}: {e}", p.display()))?;
                Self::from_json(&text)
                    .map_err(|e| format!("invalid model catalogue {}: {e}", p.display()))
            }
        }
    }

    pub fn get(&self, id: &str) -> Option<&ModelSpec> {
        self.models.iter().find(|m| m.id == id)
    }

    /// Whether `id` exists and is authorised for `org`.
    pub fn authorizes(&self, id: &str, org: &str) -> bool {
        self.get(id).is_some_and(|m| {
            m.authorized_orgs
                .iter()
                .any(|o| o == "*" || o.as_str() == org)
        })
    }

    /// Whether model `id` may run for organisation `org` where an
    /// automation of `placement` runs — the one rule creation, update,
    /// activation and every run (checked again by the coordinator before
    /// the run is dispatched) follow: the model must be in the catalogue;
    /// in the cloud it must also be authorised for the organisation
    /// (`authorized_orgs`); a desktop run uses the owner's own machine and
    /// provider, so existing is enough there.
    pub fn admits(
        &self,
        id: &str,
        org: &str,
        placement: crate::automation::Placement,
    ) -> Result<&ModelSpec, ModelRefusal> {
        let model = self.get(id).ok_or(ModelRefusal::Unknown)?;
        if placement == crate::automation::Placement::Cloud && !self.authorizes(id, org) {
            return Err(ModelRefusal::NotAuthorized);
        }
        Ok(model)
    }
}

/// Why the catalogue does not admit a model ([`ModelCatalog::admits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelRefusal {
    /// The model is not in the catalogue (unknown, or removed since).
    Unknown,
    /// The model is not authorised for the organisation in the cloud.
    NotAuthorized,
}

impl ModelRefusal {
    /// What is wrong, in words, for `model` of organisation `org`.
    pub fn explain(self, model: &str, org: &str) -> String {
        match self {
            ModelRefusal::Unknown => format!("model {model} is not in the model catalogue"),
            ModelRefusal::NotAuthorized => {
                format!("model {model} is not authorised for organisation {org}")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cost_rounds_up_to_the_micro_unit() {
        let p = Price {
            input_micros_per_million_tokens: 400_000,
            output_micros_per_million_tokens: 1_600_000,
        };
        // 1000 × 0.4 + 10 × 1.6 = 416 micro-units exactly.
        assert_eq!(p.cost_micros(1000, 10), 416);
        // 1 × 0.4 rounds up to 1.
        assert_eq!(p.cost_micros(1, 0), 1);
        assert_eq!(p.cost_micros(0, 0), 0);
        assert_eq!(p.cost_micros(-5, -5), 0);
        assert_eq!(
            Price {
                input_micros_per_million_tokens: i64::MAX,
                output_micros_per_million_tokens: i64::MAX
            }
            .cost_micros(i64::MAX, i64::MAX),
            i64::MAX
        );
    }

    #[test]
    fn provider_names_default_to_the_id_after_its_provider() {
        let catalog = ModelCatalog::from_json(
            r#"{"models": [
                {"id": "openai/gpt-4.1-mini"},
                {"id": "azure/mini", "provider_model": "gpt-4.1-mini-2025-04-14"},
                {"id": "bare"}]}"#,
        )
        .expect("catalogue");
        let name = |id| catalog.get(id).map(ModelSpec::provider_model);
        assert_eq!(name("openai/gpt-4.1-mini"), Some("gpt-4.1-mini"));
        assert_eq!(name("azure/mini"), Some("gpt-4.1-mini-2025-04-14"));
        assert_eq!(name("bare"), Some("bare"));
        assert_eq!(catalog.get("bare").and_then(|m| m.price), None);
    }

    #[test]
    fn the_catalogue_admits_a_model_where_it_may_run() {
        use crate::automation::Placement::{Cloud, Desktop};
        let catalog = ModelCatalog::from_json(
            r#"{"models": [{"id": "open"}, {"id": "acme-only", "authorized_orgs": ["acme"]}]}"#,
        )
        .expect("catalogue");
        let admits = |id, org, placement| catalog.admits(id, org, placement).map(|m| m.id.clone());
        assert_eq!(admits("open", "any", Cloud), Ok("open".into()));
        assert_eq!(admits("acme-only", "acme", Cloud), Ok("acme-only".into()));
        assert_eq!(
            admits("acme-only", "other", Cloud),
            Err(ModelRefusal::NotAuthorized)
        );
        // On the desktop the model need only exist.
        assert_eq!(
            admits("acme-only", "other", Desktop),
            Ok("acme-only".into())
        );
        for placement in [Cloud, Desktop] {
            assert_eq!(
                admits("gone", "acme", placement),
                Err(ModelRefusal::Unknown)
            );
        }
        assert_eq!(
            ModelRefusal::NotAuthorized.explain("acme-only", "other"),
            "model acme-only is not authorised for organisation other"
        );
    }

    #[test]
    fn bad_catalogues_are_refused_with_a_reason() {
        for (json, want) in [
            (r#"{"models": [{"id": "a"}, {"id": "a"}]}"#, "twice"),
            (r#"{"models": [{"id": " "}]}"#, "empty id"),
            (
                r#"{"models": [{"id": "a", "price": {"input_micros_per_million_tokens": -1, "output_micros_per_million_tokens": 0}}]}"#,
                "negative",
            ),
            (r#"{"models": [{"id": "a", "prise": {}}]}"#, "unknown field"),
        ] {
            let e = ModelCatalog::from_json(json).expect_err(json);
            assert!(e.contains(want), "{json}: {e}");
        }
    }
}
