//! Bearer authentication of the public API: HS256 JWTs whose `sub` is the
//! user and whose `org` is the organisation, verified with a key from
//! configuration. Tokens never reach a log line.

use automesh_domain::Principal;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use tonic::Status;
use tonic::metadata::MetadataMap;

/// The claims automesh reads.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Claims {
    /// The user.
    pub sub: String,
    /// The organisation.
    pub org: String,
    /// Expiry, seconds since the Unix epoch.
    pub exp: i64,
    /// Issued at, seconds since the Unix epoch.
    #[serde(default)]
    pub iat: i64,
    /// Not before, seconds since the Unix epoch: honoured with the same
    /// leeway as `exp`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbf: Option<i64>,
}

/// How far `exp` and `nbf` may be off (clock skew between issuer and mesh).
pub const LEEWAY_SECONDS: u64 = 30;

/// Verifies bearer tokens.
#[derive(Clone)]
pub struct Authenticator {
    key: DecodingKey,
    validation: Validation,
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Authenticator(HS256, <key redacted>)")
    }
}

/// Why a signing key cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("the JWT key must be at least 32 bytes")]
pub struct WeakKey;

impl Authenticator {
    /// An authenticator for HS256 tokens signed with `secret`.
    pub fn hs256(secret: &[u8]) -> Result<Self, WeakKey> {
        if secret.len() < 32 {
            return Err(WeakKey);
        }
        let mut validation = Validation::new(Algorithm::HS256);
        validation.set_required_spec_claims(&["exp", "sub"]);
        validation.leeway = LEEWAY_SECONDS;
        validation.validate_nbf = true;
        Ok(Self {
            key: DecodingKey::from_secret(secret).map_err(|_| WeakKey)?,
            validation,
        })
    }

    /// The caller named by the request's `authorization: Bearer <jwt>`.
    pub fn principal(&self, metadata: &MetadataMap) -> Result<Principal, Status> {
        let header = metadata
            .get("authorization")
            .ok_or_else(|| Status::unauthenticated("missing bearer token"))?
            .to_str()
            .map_err(|_| Status::unauthenticated("malformed authorization header"))?;
        let token = header
            .strip_prefix("Bearer ")
            .or_else(|| header.strip_prefix("bearer "))
            .ok_or_else(|| Status::unauthenticated("authorization must be `Bearer <token>`"))?;
        let data = jsonwebtoken::decode::<Claims>(token.trim(), &self.key, &self.validation)
            .map_err(|e| {
                use jsonwebtoken::errors::ErrorKind;
                let why = match e.kind() {
                    ErrorKind::InvalidSignature => "bad signature",
                    ErrorKind::ExpiredSignature => "expired",
                    ErrorKind::ImmatureSignature => "not valid yet (nbf)",
                    ErrorKind::InvalidAlgorithm => "wrong algorithm",
                    ErrorKind::MissingRequiredClaim(_) => "missing claim",
                    _ => "malformed",
                };
                Status::unauthenticated(format!("invalid bearer token: {why}"))
            })?;
        let Claims { sub, org, .. } = data.claims;
        if sub.is_empty() || org.is_empty() || sub.len() > 200 || org.len() > 200 {
            return Err(Status::unauthenticated(
                "invalid bearer token: sub and org must be 1..=200 bytes",
            ));
        }
        if sub.chars().chain(org.chars()).any(char::is_control) {
            return Err(Status::unauthenticated(
                "invalid bearer token: sub and org must not contain control characters",
            ));
        }
        Ok(Principal::new(org, sub))
    }
}

/// Signs a token for `user` of `org`, valid for `ttl` (dev mode and tests).
pub fn mint(
    secret: &[u8],
    org: &str,
    user: &str,
    ttl: chrono::Duration,
) -> Result<String, jsonwebtoken::errors::Error> {
    let now = chrono::Utc::now().timestamp();
    let claims = Claims {
        sub: user.to_owned(),
        org: org.to_owned(),
        exp: now + ttl.num_seconds(),
        iat: now,
        nbf: None,
    };
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(secret)?,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";

    fn md(token: &str) -> MetadataMap {
        let mut m = MetadataMap::new();
        m.insert(
            "authorization",
            format!("Bearer {token}").parse().expect("ascii"),
        );
        m
    }

    #[test]
    fn accepts_its_own_tokens_and_rejects_others() {
        let auth = Authenticator::hs256(KEY).expect("key");
        let token = mint(KEY, "acme", "ada", chrono::Duration::hours(1)).expect("mint");
        assert_eq!(
            auth.principal(&md(&token)).expect("valid"),
            Principal::new("acme", "ada")
        );

        let other = mint(
            b"another key that is long enough!!",
            "acme",
            "ada",
            chrono::Duration::hours(1),
        )
        .expect("mint");
        let err = auth.principal(&md(&other)).expect_err("bad signature");
        assert!(err.message().contains("bad signature"));

        let expired = mint(KEY, "acme", "ada", chrono::Duration::hours(-1)).expect("mint");
        assert!(
            auth.principal(&md(&expired))
                .expect_err("expired")
                .message()
                .contains("expired")
        );
        assert!(auth.principal(&MetadataMap::new()).is_err());
        assert!(Authenticator::hs256(b"short").is_err());

        // `nbf` is honoured, with the leeway `exp` has.
        let signed = |nbf: i64, sub: &str| {
            let now = chrono::Utc::now().timestamp();
            jsonwebtoken::encode(
                &Header::new(Algorithm::HS256),
                &Claims {
                    sub: sub.into(),
                    org: "acme".into(),
                    exp: now + 3600,
                    iat: now,
                    nbf: Some(now + nbf),
                },
                &EncodingKey::from_secret(KEY).expect("key"),
            )
            .expect("sign")
        };
        let early = auth
            .principal(&md(&signed(600, "ada")))
            .expect_err("not valid yet");
        assert!(early.message().contains("nbf"), "{early:?}");
        assert!(
            auth.principal(&md(&signed(10, "ada"))).is_ok(),
            "within the leeway"
        );
        assert!(auth.principal(&md(&signed(-10, "ada"))).is_ok());
        // A NUL in `sub` is refused up front, never sent to a database.
        let nul = auth
            .principal(&md(&signed(0, "a\u{0}da")))
            .expect_err("control character");
        assert_eq!(nul.code(), tonic::Code::Unauthenticated);
    }
}
