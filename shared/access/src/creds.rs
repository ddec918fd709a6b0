//! Credentials files: a role, for agents its tenant and name, and the nkey seed.
//!
//! The file is TOML, so a person can read who it is for; the seed is the secret. Files are
//! written with mode 0600 in a 0700 directory, and a file another user can read is refused
//! on load, as ssh refuses a readable private key.

use std::path::{Path, PathBuf};

use engram_schema::Ident;
use serde::{Deserialize, Serialize};

use crate::AccessError;
use crate::perms::{Role, ScopePattern, Service, inbox_prefix};

/// The first token of an API key.
pub const API_KEY_PREFIX: &str = "egk";

/// Which kind of identity a credentials file is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RoleName {
    Admin,
    Projectors,
    Consolidator,
    Query,
    /// The connections the services answer requests on ([`Role::Responder`]).
    ProjectorsResponder,
    ConsolidatorResponder,
    QueryResponder,
    Agent,
    /// A leaf node's connection to its hub.
    Leaf,
}

impl RoleName {
    /// The service identities `engram up` generates, besides the admin: each service's
    /// worker and its responder.
    pub const SERVICES: [RoleName; 6] = [
        Self::Projectors,
        Self::Consolidator,
        Self::Query,
        Self::ProjectorsResponder,
        Self::ConsolidatorResponder,
        Self::QueryResponder,
    ];

    /// The identity the service `worker` answers requests with.
    pub fn responder(self) -> Option<RoleName> {
        match self {
            Self::Projectors => Some(Self::ProjectorsResponder),
            Self::Consolidator => Some(Self::ConsolidatorResponder),
            Self::Query => Some(Self::QueryResponder),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Admin => "admin",
            Self::Projectors => "projectors",
            Self::Consolidator => "consolidator",
            Self::Query => "query",
            Self::ProjectorsResponder => "projectors_responder",
            Self::ConsolidatorResponder => "consolidator_responder",
            Self::QueryResponder => "query_responder",
            Self::Agent => "agent",
            Self::Leaf => "leaf",
        }
    }

    pub fn of(role: &Role) -> Self {
        match role {
            Role::Admin => Self::Admin,
            Role::Projectors => Self::Projectors,
            Role::Consolidator => Self::Consolidator,
            Role::Query => Self::Query,
            Role::Responder(Service::Projectors) => Self::ProjectorsResponder,
            Role::Responder(Service::Consolidator) => Self::ConsolidatorResponder,
            Role::Responder(Service::Query) => Self::QueryResponder,
            Role::Agent { .. } => Self::Agent,
            Role::Leaf(_) => Self::Leaf,
        }
    }

    /// The role of a service or the admin; `None` for agents, whose role needs a tenant.
    pub fn fixed_role(self) -> Option<Role> {
        match self {
            Self::Admin => Some(Role::Admin),
            Self::Projectors => Some(Role::Projectors),
            Self::Consolidator => Some(Role::Consolidator),
            Self::Query => Some(Role::Query),
            Self::ProjectorsResponder => Some(Role::Responder(Service::Projectors)),
            Self::ConsolidatorResponder => Some(Role::Responder(Service::Consolidator)),
            Self::QueryResponder => Some(Role::Responder(Service::Query)),
            Self::Agent | Self::Leaf => None,
        }
    }
}

/// One identity's key pair and who it is.
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Credentials {
    pub role: RoleName,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<Ident>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<Ident>,
    /// The nkey seed (`SU…`): the secret.
    pub seed: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the seed.
        f.debug_struct("Credentials")
            .field("role", &self.role)
            .field("tenant", &self.tenant)
            .field("agent", &self.agent)
            .field("public_key", &self.public_key())
            .finish()
    }
}

impl Credentials {
    /// A fresh key pair for a service or the admin.
    pub fn generate(role: RoleName) -> Self {
        Self {
            role,
            tenant: None,
            agent: None,
            seed: new_seed(),
        }
    }

    /// A fresh key pair for `agent` of `tenant`.
    pub fn generate_agent(tenant: Ident, agent: Ident) -> Self {
        Self {
            role: RoleName::Agent,
            tenant: Some(tenant),
            agent: Some(agent),
            seed: new_seed(),
        }
    }

    /// The public key the server knows this identity by.
    pub fn public_key(&self) -> String {
        nkeys::KeyPair::from_seed(&self.seed)
            .map(|k| k.public_key())
            .unwrap_or_default()
    }

    /// The tenant and agent of agent credentials.
    pub fn agent_identity(&self) -> Option<(&Ident, &Ident)> {
        match (self.role, &self.tenant, &self.agent) {
            (RoleName::Agent, Some(t), Some(a)) => Some((t, a)),
            _ => None,
        }
    }

    /// Where replies to this identity's requests arrive; its permissions allow no other.
    pub fn inbox_prefix(&self) -> String {
        match self.agent_identity() {
            Some((tenant, agent)) => inbox_prefix(&Role::Agent {
                tenant: tenant.clone(),
                agent: agent.clone(),
                scopes: Vec::<ScopePattern>::new(),
            }),
            None => inbox_prefix(&self.role.fixed_role().unwrap_or(Role::Admin)),
        }
    }

    fn validate(&self) -> Result<(), String> {
        let key = nkeys::KeyPair::from_seed(&self.seed)
            .map_err(|e| format!("the seed is not an nkey seed: {e}"))?;
        if !key.public_key().starts_with('U') {
            return Err("the seed is not a user nkey seed (SU…)".into());
        }
        match (self.role, &self.tenant, &self.agent) {
            (RoleName::Agent, Some(_), Some(_)) => Ok(()),
            (RoleName::Agent, _, _) => Err("agent credentials name a tenant and an agent".into()),
            (_, None, None) => Ok(()),
            _ => Err("only agent credentials name a tenant or an agent".into()),
        }
    }

    /// The API key of agent credentials: `egk.<tenant>.<agent>.<seed>`. It is the
    /// credentials themselves (whoever holds it is the agent), in one header-safe line; the
    /// gateway connects to NATS with the seed, so NATS enforces the same permissions.
    pub fn api_key(&self) -> Option<String> {
        let (tenant, agent) = self.agent_identity()?;
        Some(format!("{API_KEY_PREFIX}.{tenant}.{agent}.{}", self.seed))
    }

    /// Agent credentials from an API key ([`Self::api_key`]), checked like a file.
    pub fn from_api_key(key: &str) -> Result<Self, AccessError> {
        let bad = |reason: &str| AccessError::BadCredentials {
            path: "the API key".into(),
            reason: reason.to_owned(),
        };
        if key.len() > 512 {
            return Err(bad("it is too long"));
        }
        let mut parts = key.trim().split('.');
        let (Some(API_KEY_PREFIX), Some(tenant), Some(agent), Some(seed), None) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return Err(bad("it is not of the form egk.<tenant>.<agent>.<seed>"));
        };
        let creds = Self {
            role: RoleName::Agent,
            tenant: Some(Ident::parse("tenant", tenant).map_err(|_| bad("bad tenant"))?),
            agent: Some(Ident::parse("agent", agent).map_err(|_| bad("bad agent"))?),
            seed: seed.to_owned(),
        };
        creds.validate().map_err(|e| bad(&e))?;
        Ok(creds)
    }

    /// Writes the file with mode 0600 (its directory 0700), replacing any file there.
    pub fn save(&self, path: &Path) -> Result<(), AccessError> {
        let who = match self.agent_identity() {
            Some((t, a)) => format!("agent {a} of tenant {t}"),
            None => format!("the {} identity", self.role.as_str()),
        };
        let body = toml::to_string(self).map_err(|e| AccessError::File {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        let text = format!(
            "# Engram credentials for {who} (public key {}).\n# Whoever holds this file acts as that identity: keep it secret.\n{body}",
            self.public_key()
        );
        save_private(path, &text)
    }

    /// Reads a credentials file, refusing one that other users can read.
    pub fn load(path: &Path) -> Result<Self, AccessError> {
        let text = read_private(path)?;
        let bad = |reason: String| AccessError::BadCredentials {
            path: path.display().to_string(),
            reason,
        };
        let creds: Self = toml::from_str(&text).map_err(|e| bad(e.to_string()))?;
        creds.validate().map_err(bad)?;
        Ok(creds)
    }
}

/// The text of a secret file (at most 64 KiB), refusing one that other users can read, as
/// ssh refuses a readable private key.
pub fn read_private(path: &Path) -> Result<String, AccessError> {
    use std::os::unix::fs::PermissionsExt as _;
    let bad = |reason: String| AccessError::BadCredentials {
        path: path.display().to_string(),
        reason,
    };
    let meta = std::fs::metadata(path).map_err(|e| AccessError::File {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(bad(format!(
            "it is readable by other users (mode {:o}); run `chmod 600 {}`",
            meta.permissions().mode() & 0o777,
            path.display()
        )));
    }
    if meta.len() > 64 * 1024 {
        return Err(bad("it is larger than 64 KiB".into()));
    }
    std::fs::read_to_string(path).map_err(|e| AccessError::File {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

/// Creates `path`'s directory (mode 0700) and writes `text` to it with mode 0600.
pub fn save_private(path: &Path, text: &str) -> Result<(), AccessError> {
    use std::os::unix::fs::DirBuilderExt as _;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| AccessError::File {
                path: path.display().to_string(),
                reason: e.to_string(),
            })?;
    }
    crate::write_private(path, text)
}

pub(crate) fn new_seed() -> String {
    nkeys::KeyPair::new_user()
        .seed()
        .expect("a generated key pair has a seed")
}

/// The credentials `engram up` keeps in its home: `<home>/auth/<role>.creds`.
pub fn service_path(home: &Path, role: RoleName) -> PathBuf {
    home.join("auth").join(format!("{}.creds", role.as_str()))
}

/// Where `engram agent add` writes an agent's credentials unless told otherwise.
pub fn agent_path(home: &Path, tenant: &Ident, agent: &Ident, public_key: &str) -> PathBuf {
    let short = &public_key[public_key.len().saturating_sub(8)..];
    home.join("auth")
        .join("agents")
        .join(tenant.as_str())
        .join(format!("{agent}-{short}.creds"))
}

/// The service and admin credentials in `home`, generating those that are missing.
pub fn ensure_service_credentials(
    home: &Path,
) -> Result<Vec<(RoleName, Credentials)>, AccessError> {
    let mut all = Vec::new();
    for role in std::iter::once(RoleName::Admin).chain(RoleName::SERVICES) {
        let path = service_path(home, role);
        let creds = if path.exists() {
            Credentials::load(&path)?
        } else {
            let creds = Credentials::generate(role);
            creds.save(&path)?;
            creds
        };
        if creds.role != role {
            return Err(AccessError::BadCredentials {
                path: path.display().to_string(),
                reason: format!("it holds {} credentials", creds.role.as_str()),
            });
        }
        all.push((role, creds));
    }
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saved_credentials_load_back_private_and_a_readable_file_is_refused() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let creds = Credentials::generate_agent(
            Ident::parse("t", "acme").unwrap(),
            Ident::parse("a", "planner").unwrap(),
        );
        let path = dir.path().join("x/planner.creds");
        creds.save(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let back = Credentials::load(&path).unwrap();
        assert_eq!(back.public_key(), creds.public_key());
        assert_eq!(back.inbox_prefix(), "_INBOX.a.acme.planner");
        assert!(!format!("{back:?}").contains(&creds.seed));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = Credentials::load(&path).unwrap_err().to_string();
        assert!(err.contains("chmod 600"), "{err}");
    }

    #[test]
    fn an_api_key_is_the_agent_credentials_in_one_line() {
        let creds = Credentials::generate_agent(
            Ident::parse("t", "acme").unwrap(),
            Ident::parse("a", "planner").unwrap(),
        );
        let key = creds.api_key().unwrap();
        assert!(key.starts_with("egk.acme.planner.SU"), "{key}");
        let back = Credentials::from_api_key(&key).unwrap();
        assert_eq!(back.public_key(), creds.public_key());
        for bad in [
            "egk.acme.planner",
            "egk.acme.planner.SUNOTASEED",
            "xyz.acme.planner.SU",
            "egk.acme.*.SU",
            &format!("{key}.extra"),
        ] {
            assert!(Credentials::from_api_key(bad).is_err(), "{bad}");
        }
        assert!(Credentials::generate(RoleName::Query).api_key().is_none());
    }

    #[test]
    fn a_file_naming_a_tenant_for_a_service_or_holding_a_bad_seed_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut creds = Credentials::generate(RoleName::Query);
        creds.tenant = Some(Ident::parse("t", "acme").unwrap());
        let path = dir.path().join("q.creds");
        creds.save(&path).unwrap();
        assert!(Credentials::load(&path).is_err());
        let mut creds = Credentials::generate(RoleName::Query);
        creds.seed = "SUNOTASEED".into();
        creds.save(&path).unwrap();
        assert!(Credentials::load(&path).is_err());
    }
}
