//! The internal service credential: a shared secret every internal call
//! carries as `authorization: Bearer <secret>`, checked by every internal
//! service. (mTLS can replace it at deployment; the check stays the same.)

use std::sync::Arc;

use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// The header a cloud worker's agent reads the internal host credential
/// from (beside `authorization: Bearer <collaborator token>`).
pub const HOST_CREDENTIAL_HEADER: &str = "x-automesh-host-credential";

/// The secret shared by the services of one mesh. Its `Debug` never prints it.
#[derive(Clone)]
pub struct InternalCredential(Arc<str>);

impl std::fmt::Debug for InternalCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InternalCredential(<redacted>)")
    }
}

/// Why a credential cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CredentialError {
    #[error("the internal credential must be at least 16 visible ASCII characters")]
    TooWeak,
}

impl InternalCredential {
    pub fn new(secret: impl Into<String>) -> Result<Self, CredentialError> {
        let secret = secret.into();
        if secret.len() < 16 || !secret.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(CredentialError::TooWeak);
        }
        Ok(Self(secret.into()))
    }

    pub(crate) fn header_value(&self) -> MetadataValue<tonic::metadata::Ascii> {
        // Visible ASCII was checked in `new`.
        MetadataValue::try_from(format!("Bearer {}", self.0))
            .unwrap_or_else(|_| MetadataValue::from_static("Bearer invalid"))
    }

    /// A secret derived from this one for `label` (HMAC-SHA256, hex): every
    /// replica derives the same value, so derived secrets (a worker's
    /// collaborator token, the host credential) never need storing.
    pub fn derive(&self, label: &str) -> String {
        use sha2::{Digest, Sha256};
        let mut key = [0u8; 64];
        let secret = self.0.as_bytes();
        if secret.len() > 64 {
            key[..32].copy_from_slice(&Sha256::digest(secret));
        } else {
            key[..secret.len()].copy_from_slice(secret);
        }
        let pad = |b: u8| key.iter().map(|k| k ^ b).collect::<Vec<u8>>();
        let inner = Sha256::new()
            .chain_update(pad(0x36))
            .chain_update(label.as_bytes())
            .finalize();
        let outer = Sha256::new()
            .chain_update(pad(0x5c))
            .chain_update(inner)
            .finalize();
        hex::encode(outer)
    }

    fn matches(&self, presented: &[u8]) -> bool {
        let expected = format!("Bearer {}", self.0);
        constant_time_eq(expected.as_bytes(), presented)
    }
}

/// Compares without an early exit on the first differing byte.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Server-side interceptor that admits only calls with the internal credential.
#[derive(Clone, Debug)]
pub struct RequireInternal(pub InternalCredential);

impl Interceptor for RequireInternal {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        match req.metadata().get("authorization") {
            Some(v) if self.0.matches(v.as_bytes()) => Ok(req),
            _ => Err(Status::unauthenticated(
                "missing or invalid internal service credential",
            )),
        }
    }
}

#[cfg(test)]
mod derive_tests {
    use super::*;
    use automesh_domain::Secret;

    #[test]
    fn derived_secrets_are_stable_distinct_and_hide_the_parent() {
        // RFC 4231 test case 2: key "Jefe", data "what do ya want for nothing?".
        let c = InternalCredential("Jefe".into());
        assert_eq!(
            c.derive("what do ya want for nothing?"),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        let c = InternalCredential::new("a-mesh-internal-credential").expect("credential");
        assert_eq!(c.derive("worker:1"), c.derive("worker:1"));
        assert_ne!(c.derive("worker:1"), c.derive("worker:2"));
        assert!(!c.derive("worker:1").contains("a-mesh-internal-credential"));
    }

    #[test]
    fn secrets_and_credentials_never_print_themselves() {
        let secret = Secret::from("sk-never-printed-0123");
        let credential =
            InternalCredential::new("internal-never-printed-0123").expect("credential");
        #[derive(Debug)]
        #[allow(dead_code)]
        struct Config {
            key: Secret,
            optional: Option<Secret>,
            credential: InternalCredential,
        }
        let config = Config {
            key: secret.clone(),
            optional: Some(secret.clone()),
            credential,
        };
        let printed = format!("{config:?} {config:#?}");
        assert!(!printed.contains("never-printed"), "{printed}");
        assert!(printed.contains("<redacted>"));
        assert_eq!(secret.expose(), "sk-never-printed-0123");
    }
}
