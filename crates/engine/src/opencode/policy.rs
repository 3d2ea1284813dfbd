//! The headless permission policy of an OpenCode run: an allow-list of
//! permission kinds and patterns, per automation with a default.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// One allow-list entry: a permission kind (`bash`, `edit`, `read`, …, or
/// `*`) and the patterns it covers (`*` wildcards; empty = any pattern).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PermissionRule {
    pub permission: String,
    #[serde(default)]
    pub patterns: Vec<String>,
}

/// The headless permission policy of a run: what is not allowed is
/// rejected and ends the run `permission_denied`. The default allows
/// nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PermissionPolicy {
    #[serde(default)]
    pub allow: Vec<PermissionRule>,
}

/// Policies per automation, with a default; read from a JSON document:
/// `{"default": {"allow": [...]}, "automations": {"<id>": {"allow": [...]}}}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyBook {
    #[serde(default)]
    pub default: PermissionPolicy,
    #[serde(default)]
    pub automations: HashMap<String, PermissionPolicy>,
}

impl PolicyBook {
    pub fn for_automation(&self, automation_id: &str) -> &PermissionPolicy {
        self.automations.get(automation_id).unwrap_or(&self.default)
    }
}

/// `*` matches any run of characters; everything else literally.
pub fn glob(pattern: &str, text: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == text;
    }
    let mut rest = text;
    for (i, part) in parts.iter().enumerate() {
        if i == 0 {
            let Some(r) = rest.strip_prefix(part) else {
                return false;
            };
            rest = r;
        } else if i == parts.len() - 1 {
            return rest.ends_with(part);
        } else {
            match rest.find(part) {
                Some(at) => rest = &rest[at + part.len()..],
                None => return false,
            }
        }
    }
    true
}

impl PermissionPolicy {
    /// Whether a prompt for `permission` over `patterns` is allowed: one
    /// rule of that kind must cover every pattern.
    pub fn allows(&self, permission: &str, patterns: &[String]) -> bool {
        self.allow.iter().any(|rule| {
            (rule.permission == "*" || rule.permission == permission)
                && (rule.patterns.is_empty()
                    || patterns
                        .iter()
                        .all(|p| rule.patterns.iter().any(|r| glob(r, p))))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_like_shell_patterns() {
        assert!(glob("echo *", "echo hi"));
        assert!(glob("*", "anything at all"));
        assert!(glob("git * --dry-run", "git push origin --dry-run"));
        assert!(!glob("echo *", "rm -rf /"));
        assert!(glob("exact", "exact"));
        assert!(!glob("exact", "exactly"));
    }

    #[test]
    fn the_policy_needs_one_rule_covering_every_pattern() {
        let p = PermissionPolicy {
            allow: vec![
                PermissionRule {
                    permission: "bash".into(),
                    patterns: vec!["echo *".into()],
                },
                PermissionRule {
                    permission: "read".into(),
                    patterns: vec![],
                },
            ],
        };
        assert!(p.allows("bash", &["echo hi".into()]));
        assert!(!p.allows("bash", &["echo hi".into(), "rm x".into()]));
        assert!(p.allows("read", &["/etc/hosts".into()]));
        assert!(!p.allows("edit", &["a.txt".into()]));
        assert!(!PermissionPolicy::default().allows("bash", &["echo hi".into()]));
    }
}
