//! CSRF protection for the dashboard's actions: a signed double-submit token.
//!
//! # Why this shape
//!
//! Every page sets a cookie holding `nonce.mac`, where `mac` is SHA-256 over a secret
//! and the nonce; every form carries the same token in a hidden field. A POST is
//! accepted only when the field equals the cookie and the mac is the dashboard's own.
//! Another site can make a browser send the cookie but cannot read it to fill the
//! field; a sibling host that can write cookies cannot mint one that verifies. The
//! cookie is `SameSite=Strict` and `HttpOnly` besides.
//!
//! The secret is drawn once per process, so a token minted by one actix worker
//! verifies on every other, and no server-side session is kept. A restart invalidates
//! the tokens of open pages: their next action is refused and a reload mends it.

use std::sync::OnceLock;

use actix_web::cookie::{Cookie, SameSite};
use actix_web::HttpRequest;
use rand::RngCore;
use sha2::{Digest, Sha256};

/// The cookie's name.
pub(crate) const COOKIE: &str = "leasehold_csrf";

/// The hidden form field's name.
pub(crate) const FIELD: &str = "csrf";

/// The dashboard's secret.
pub(crate) struct Csrf {
    secret: [u8; 32],
}

impl Csrf {
    /// The process's secret: actix-web builds the app once per worker, and a token a
    /// page served by one worker minted must verify on every other.
    pub(crate) fn new() -> Self {
        static SECRET: OnceLock<[u8; 32]> = OnceLock::new();
        let secret = *SECRET.get_or_init(|| {
            let mut secret = [0u8; 32];
            rand::thread_rng().fill_bytes(&mut secret);
            secret
        });
        Csrf { secret }
    }

    fn mac(&self, nonce: &str) -> String {
        let mut h = Sha256::new();
        h.update(self.secret);
        h.update(b"leasehold-dashboard-csrf");
        h.update(nonce.as_bytes());
        hex(&h.finalize())
    }

    fn mint(&self) -> String {
        let mut nonce = [0u8; 16];
        rand::thread_rng().fill_bytes(&mut nonce);
        let nonce = hex(&nonce);
        let mac = self.mac(&nonce);
        format!("{nonce}.{mac}")
    }

    fn valid(&self, token: &str) -> bool {
        match token.split_once('.') {
            Some((nonce, mac)) => constant_time_eq(mac.as_bytes(), self.mac(nonce).as_bytes()),
            None => false,
        }
    }

    /// The token of this browser (its cookie's, if valid) and, when it had none, the
    /// cookie to set with the page.
    pub(crate) fn token_for(
        &self,
        req: &HttpRequest,
        path: &str,
    ) -> (String, Option<Cookie<'static>>) {
        if let Some(c) = req.cookie(COOKIE) {
            if self.valid(c.value()) {
                return (c.value().to_string(), None);
            }
        }
        let token = self.mint();
        let cookie = Cookie::build(COOKIE, token.clone())
            .path(path.to_string())
            .http_only(true)
            .same_site(SameSite::Strict)
            .finish();
        (token, Some(cookie))
    }

    /// A POST may act: its field equals its cookie, and the token is ours.
    pub(crate) fn check(&self, req: &HttpRequest, field: Option<&str>) -> bool {
        let (Some(cookie), Some(field)) = (req.cookie(COOKIE), field) else {
            return false;
        };
        constant_time_eq(cookie.value().as_bytes(), field.as_bytes()) && self.valid(field)
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Compares without stopping at the first difference, so the time taken does not tell
/// how much of a guess was right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_minted_token_verifies_and_a_forged_one_does_not() {
        let csrf = Csrf::new();
        let token = csrf.mint();
        assert!(csrf.valid(&token));
        let (nonce, _) = token.split_once('.').unwrap();
        assert!(!csrf.valid(&format!("{nonce}.{}", "0".repeat(64))));
        let other = Csrf { secret: [7; 32] };
        assert!(!other.valid(&token), "another secret's token");
        assert!(!csrf.valid("no-dot"));
    }
}
