//! The fleet's operations on etcd, through the `etcd-client` crate: a connection with
//! the configured endpoints, TLS and credentials, and the few transactions the sync
//! loop needs, each bounded in time and its errors sorted into [`FleetError`]s.
use std::{future::Future, time::Duration};

use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, GetOptions, Identity,
    LeaseKeepAliveStream, LeaseKeeper, PutOptions, TlsOptions, Txn, TxnOp, TxnOpResponse,
    WatchOptions, WatchStream,
};

use super::{
    FleetError, StoreConfig,
    record::{Keys, Record},
};

/// A connection to the fleet's etcd.
pub struct Store {
    client: Client,
    pub keys: Keys,
    context: Context,
}

/// What an error names, and how long a request may take.
struct Context {
    endpoints: String,
    user: Option<String>,
    timeout: Duration,
}

/// One key of the fleet's prefix as listed.
pub struct Listed {
    pub key: String,
    pub mod_revision: i64,
    pub value: Vec<u8>,
}

/// How a raise went.
pub enum Raised {
    Yes,
    /// Another claim grew since the view it was computed from: recompute.
    Conflict,
}

impl Store {
    /// Connects (lazily: an unreachable endpoint shows at the first request; credentials
    /// are checked here, when there are some).
    pub async fn connect(config: &StoreConfig, timeout: Duration) -> Result<Store, FleetError> {
        let mut options = ConnectOptions::new()
            .with_connect_timeout(timeout)
            .with_keep_alive(timeout, timeout)
            .with_auto_token_refresh(true);
        if let Some(c) = &config.credentials {
            options = options.with_user(&c.user, &c.password);
        }
        if let Some(tls) = &config.tls {
            options = options.with_tls(tls_options(tls)?);
        }
        let context = Context {
            endpoints: config.endpoints.join(","),
            user: config.credentials.as_ref().map(|c| c.user.clone()),
            timeout,
        };
        let client = context
            .bounded(
                "connecting",
                Client::connect(&config.endpoints, Some(options)),
            )
            .await?;
        Ok(Store {
            client,
            keys: Keys::new(&config.prefix),
            context,
        })
    }

    /// Sorts an error of a stream the caller polls (a watch, the lease's keep-alives).
    pub fn error(&self, what: &str, e: etcd_client::Error) -> FleetError {
        self.context.sort(what, e)
    }

    /// A new lease of `ttl`; returns its id and the TTL etcd granted.
    pub async fn grant(&mut self, ttl: Duration) -> Result<(i64, i64), FleetError> {
        let secs = ttl.as_secs().max(1) as i64;
        let r = self
            .context
            .bounded("granting a lease", self.client.lease_grant(secs, None))
            .await?;
        Ok((r.id(), r.ttl()))
    }

    /// The lease's remaining TTL in seconds, if it is alive.
    pub async fn lease_ttl(&mut self, lease: i64) -> Result<Option<i64>, FleetError> {
        let r = self
            .context
            .bounded(
                "reading a lease",
                self.client.lease_time_to_live(lease, None),
            )
            .await?;
        Ok((r.ttl() > 0).then_some(r.ttl()))
    }

    pub async fn keep_alive(
        &mut self,
        lease: i64,
    ) -> Result<(LeaseKeeper, LeaseKeepAliveStream), FleetError> {
        self.context
            .bounded(
                "keeping the lease alive",
                self.client.lease_keep_alive(lease),
            )
            .await
    }

    pub async fn revoke(&mut self, lease: i64) -> Result<(), FleetError> {
        self.context
            .bounded("revoking the lease", self.client.lease_revoke(lease))
            .await
            .map(drop)
    }

    /// Every key of the fleet's prefix, and the revision they are as of.
    pub async fn list(&mut self) -> Result<(i64, Vec<Listed>), FleetError> {
        let prefix = self.keys.prefix().to_string();
        let mut r = self
            .context
            .bounded(
                "listing the fleet",
                self.client
                    .get(prefix, Some(GetOptions::new().with_prefix())),
            )
            .await?;
        let revision = r.header().map_or(0, |h| h.revision());
        let listed = r
            .take_kvs()
            .into_iter()
            .map(|kv| {
                let mod_revision = kv.mod_revision();
                let (key, value) = kv.into_key_value();
                Listed {
                    key: String::from_utf8_lossy(&key).into_owned(),
                    mod_revision,
                    value,
                }
            })
            .collect();
        Ok((revision, listed))
    }

    /// Every change to the fleet's prefix after `revision`.
    pub async fn watch(&mut self, revision: i64) -> Result<WatchStream, FleetError> {
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1);
        let prefix = self.keys.prefix().to_string();
        self.context
            .bounded(
                "watching the fleet",
                self.client.watch(prefix, Some(options)),
            )
            .await
    }

    /// Creates the host's record unless its key exists; returns what is there instead.
    pub async fn create(
        &mut self,
        budget: &str,
        record: &Record,
        bump: bool,
    ) -> Result<Option<Record>, FleetError> {
        let key = self.keys.host(budget, &record.identity);
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then(self.writes(budget, record, bump)?)
            .or_else([TxnOp::get(key, None)]);
        let r = self.txn("creating the host's record", txn).await?;
        if r.succeeded() {
            return Ok(None);
        }
        Ok(Some(existing(&r).ok_or_else(|| {
            FleetError::Store("the host's record vanished while being created".into())
        })?))
    }

    /// Writes the host's record, under its new lease, over its record under the lease
    /// `old`; false when the key no longer holds that lease.
    pub async fn take_over(
        &mut self,
        budget: &str,
        record: &Record,
        old: i64,
        bump: bool,
    ) -> Result<bool, FleetError> {
        let key = self.keys.host(budget, &record.identity);
        let txn = Txn::new()
            .when([Compare::lease(key, CompareOp::Equal, old)])
            .and_then(self.writes(budget, record, bump)?);
        let r = self.txn("taking over the host's record", txn).await?;
        Ok(r.succeeded())
    }

    /// Writes the host's record over its own (same lease); a record of another lease
    /// or none at all comes back as the error.
    pub async fn publish(
        &mut self,
        budget: &str,
        record: &Record,
        bump: bool,
    ) -> Result<(), FleetError> {
        let txn = self
            .own(budget, record, [])
            .and_then(self.writes(budget, record, bump)?)
            .or_else([TxnOp::get(self.keys.host(budget, &record.identity), None)]);
        let r = self.txn("publishing the host's record", txn).await?;
        if r.succeeded() {
            return Ok(());
        }
        Err(not_ours(budget, record, existing(&r)))
    }

    /// Raises the host's share: writes its record only if no claim on the budget grew
    /// since the raise key's `seen` mod_revision, and bumps the raise key.
    pub async fn raise(
        &mut self,
        budget: &str,
        record: &Record,
        seen: i64,
    ) -> Result<Raised, FleetError> {
        let raise = Compare::mod_revision(self.keys.raise(budget), CompareOp::Equal, seen);
        let txn = self
            .own(budget, record, [raise])
            .and_then(self.writes(budget, record, true)?)
            .or_else([TxnOp::get(self.keys.host(budget, &record.identity), None)]);
        let r = self.txn("raising the host's share", txn).await?;
        if r.succeeded() {
            return Ok(Raised::Yes);
        }
        match existing(&r) {
            Some(e) if e.lease == record.lease => Ok(Raised::Conflict),
            other => Err(not_ours(budget, record, other)),
        }
    }

    /// A transaction whose first condition is that the host's key holds its lease.
    fn own<const N: usize>(&self, budget: &str, record: &Record, more: [Compare; N]) -> Txn {
        let key = self.keys.host(budget, &record.identity);
        let mut when = vec![Compare::lease(key, CompareOp::Equal, record.lease)];
        when.extend(more);
        Txn::new().when(when)
    }

    fn writes(&self, budget: &str, record: &Record, bump: bool) -> Result<Vec<TxnOp>, FleetError> {
        let value = serde_json::to_vec(record)
            .map_err(|e| FleetError::Store(format!("encoding the record: {e}")))?;
        let mut ops = vec![TxnOp::put(
            self.keys.host(budget, &record.identity),
            value,
            Some(PutOptions::new().with_lease(record.lease)),
        )];
        if bump {
            ops.push(TxnOp::put(self.keys.raise(budget), Vec::new(), None));
        }
        Ok(ops)
    }

    async fn txn(&mut self, what: &str, txn: Txn) -> Result<etcd_client::TxnResponse, FleetError> {
        self.context.bounded(what, self.client.txn(txn)).await
    }
}

impl Context {
    /// Runs one request within the store's timeout, its error sorted.
    async fn bounded<T>(
        &self,
        what: &str,
        request: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, FleetError> {
        match tokio::time::timeout(self.timeout, request).await {
            Ok(Ok(t)) => Ok(t),
            Ok(Err(e)) => Err(self.sort(what, e)),
            Err(_) => Err(FleetError::Unreachable {
                endpoints: self.endpoints.clone(),
                reason: format!("{what}: no answer within {:?}", self.timeout),
            }),
        }
    }

    fn sort(&self, what: &str, e: etcd_client::Error) -> FleetError {
        use etcd_client::Error as E;
        let reason = format!("{what}: {e}");
        match &e {
            E::GRpcStatus(s) => {
                let m = s.message();
                let credentials = matches!(
                    s.code(),
                    tonic::Code::Unauthenticated | tonic::Code::PermissionDenied
                ) || [
                    "authentication failed",
                    "user name is empty",
                    "permission denied",
                    "invalid auth token",
                ]
                .iter()
                .any(|p| m.contains(p));
                if credentials {
                    FleetError::Credentials {
                        user: self.user.clone().unwrap_or_else(|| "(none)".into()),
                        reason,
                    }
                } else if matches!(
                    s.code(),
                    tonic::Code::Unavailable
                        | tonic::Code::DeadlineExceeded
                        | tonic::Code::Cancelled
                        | tonic::Code::Unknown
                ) {
                    FleetError::Unreachable {
                        endpoints: self.endpoints.clone(),
                        reason,
                    }
                } else {
                    FleetError::Store(reason)
                }
            }
            E::TransportError(_) | E::IoError(_) | E::LeaseKeepAliveError(_) => {
                FleetError::Unreachable {
                    endpoints: self.endpoints.clone(),
                    reason,
                }
            }
            E::InvalidUri(_) | E::EndpointError(_) | E::InvalidArgs(_) => {
                FleetError::Config(format!("etcd endpoints {}: {reason}", self.endpoints))
            }
            _ => FleetError::Store(reason),
        }
    }
}

/// The record a failed transaction's `get` of the host's key returned.
fn existing(r: &etcd_client::TxnResponse) -> Option<Record> {
    r.op_responses().into_iter().find_map(|op| match op {
        TxnOpResponse::Get(g) => g
            .kvs()
            .first()
            .and_then(|kv| serde_json::from_slice(kv.value()).ok()),
        _ => None,
    })
}

/// The host's key does not hold its lease: the lease is gone (expired, or the store
/// lost it), or another live host took the identity.
fn not_ours(budget: &str, record: &Record, there: Option<Record>) -> FleetError {
    match there {
        Some(other) => FleetError::IdentityTaken {
            identity: record.identity.clone(),
            budget: budget.to_string(),
            lease: other.lease,
        },
        None => FleetError::LeaseLost {
            lease: record.lease,
        },
    }
}

fn tls_options(tls: &super::TlsConfig) -> Result<TlsOptions, FleetError> {
    let read = |what: &str, path: &std::path::Path| {
        std::fs::read(path)
            .map_err(|e| FleetError::Config(format!("etcd TLS {what} {}: {e}", path.display())))
    };
    let mut options = TlsOptions::new();
    if let Some(ca) = &tls.ca {
        options = options.ca_certificate(Certificate::from_pem(read("CA", ca)?));
    }
    match (&tls.cert, &tls.key) {
        (Some(cert), Some(key)) => {
            options = options.identity(Identity::from_pem(
                read("certificate", cert)?,
                read("key", key)?,
            ));
        }
        (None, None) => {}
        _ => {
            return Err(FleetError::Config(
                "etcd TLS: a client certificate needs its key and a key its certificate".into(),
            ));
        }
    }
    if let Some(domain) = &tls.domain {
        options = options.domain_name(domain);
    }
    Ok(options)
}
