//! The model catalogue: which model ids exist and which organisations they
//! are authorised for. Creation rejects an unknown model as bad input and an
//! unauthorised one (for cloud placement) as a failed precondition.

use serde::{Deserialize, Serialize};

/// One model the mesh can run.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ModelSpec {
    /// The id users pick, such as `openai/gpt-4.1-mini`.
    pub id: String,
    /// Organisations the model is authorised for; `*` means every one.
    #[serde(default = "all_orgs")]
    pub authorized_orgs: Vec<String>,
}

fn all_orgs() -> Vec<String> {
    vec!["*".to_owned()]
}

/// The models known to the mesh.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ModelCatalog {
    pub models: Vec<ModelSpec>,
}

impl ModelCatalog {
    /// The catalogue `dev` mode starts with when none is configured.
    pub fn development() -> Self {
        let model = |id: &str| ModelSpec {
            id: id.to_owned(),
            authorized_orgs: all_orgs(),
        };
        Self {
            models: vec![
                model("openai/gpt-4.1-mini"),
                model("openai/gpt-4.1"),
                model("fake/echo"),
            ],
        }
    }

    /// Reads a catalogue from its JSON form (`{"models": [...]}`).
    pub fn from_json(json: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(json)
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
}
