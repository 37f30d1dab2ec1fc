//! What a handler knows about its attempt: identity, fencing token, cancellation, and
//! the effect helpers.
//!
//! # Effects
//!
//! An external effect (a charge, a webhook) must not happen twice. Each effect gets an
//! [`EffectKey`] derived from the job's effect identity (a random UUID minted with the
//! job), the job id and a step name the handler chooses, never from the generation or
//! attempt: every attempt of a step shares it, so the effect store can deduplicate, and
//! no other job of any schema, database or restored backup has it. [`JobContext::once`] runs an effect under its key and records its
//! outcome in the ledger (fenced: only the current generation may record); a later
//! attempt gets the recorded outcome back instead of acting again.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering::SeqCst};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::Serialize;
use sha2::{Digest, Sha256};
use sqlx::PgConnection;
use tokio_util::sync::CancellationToken;

use crate::handler::JobError;
use crate::job::{ClaimedJob, CompleteOutcome, EffectIdentity, Fence, Generation, JobId, NewJob};
use crate::store::{Lookup, RecordOutcome, Store};

/// Why a handler was asked to stop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CancelReason {
    /// A renewal found the lease gone: another worker may own the job now. Stop, and do
    /// not start new effects.
    LeaseLost,
    /// The scheduler is shutting down and the grace period ended.
    Shutdown,
    /// The attempt exceeded the maximum run time.
    Timeout,
    /// An operator cancelled the job while it ran. Stop: if the handler still returns
    /// `Ok`, the job is done (the work happened); an error or a stop makes it
    /// cancelled.
    Cancelled,
}

/// A stable effect key: `"<job's effect identity>/<job id>/<step>"`, e.g.
/// `"0b9f2c4e-5d1a-4e8b-9c3f-7a6d5e4b3c2a/17/charge"`.
///
/// Unique to the job: job ids restart at 1 in each schema (and in a schema created
/// again) and rewind in a schema restored from an older dump, so the key starts with
/// the job's own identity, a random UUID minted when it was enqueued
/// ([`EffectIdentity`]). Stable across the attempts of the job, a failover (a standby
/// has the same rows) and a pg_dump/restore (the same job keeps its identity, under any
/// schema or database name).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct EffectKey(String);

const IDENTITY_LEN: usize = EffectIdentity::LEN;

impl EffectKey {
    /// The key of effect `step` of the job `job` whose effect identity is `identity`: the
    /// same for every attempt of the job, so never put an attempt number or generation
    /// in `step`.
    pub fn new(identity: &EffectIdentity, job: JobId, step: &str) -> Self {
        EffectKey(format!("{identity}/{job}/{step}"))
    }

    /// `text` as an effect key, if it is one [`EffectKey::new`] could have made: an
    /// effect identity, `/`, a job id as it prints, `/`, and a step (any text, `/`
    /// included).
    pub fn parse(text: &str) -> Option<EffectKey> {
        let rest = text.get(IDENTITY_LEN..)?.strip_prefix('/')?;
        EffectIdentity::parse(&text[..IDENTITY_LEN])?;
        let (job, _step) = rest.split_once('/')?;
        let id: i64 = job.parse().ok()?;
        (id.to_string() == job).then(|| EffectKey(text.to_string()))
    }

    /// The effect identity of the job whose key it is.
    pub fn identity(&self) -> &str {
        &self.0[..IDENTITY_LEN]
    }

    /// The job whose effect it is.
    pub fn job(&self) -> JobId {
        let (job, _) = self.job_and_step();
        JobId(job.parse().unwrap_or_default())
    }

    /// The step name the handler gave.
    pub fn step(&self) -> &str {
        self.job_and_step().1
    }

    fn job_and_step(&self) -> (&str, &str) {
        // Made by `new` or checked by `parse`: the identity, `/`, digits, `/`, the step.
        self.0[IDENTITY_LEN + 1..]
            .split_once('/')
            .unwrap_or_default()
    }

    /// The key as text, to send to an effect store as its idempotency key.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for EffectKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The handler's view of its attempt. Cheap to clone.
#[derive(Clone)]
pub struct JobContext {
    inner: Arc<Inner>,
}

struct Inner {
    job: ClaimedJob,
    store: Store,
    cancel: CancellationToken,
    reason: Mutex<Option<CancelReason>>,
    effect_keep: Duration,
    completed_in_tx: Mutex<bool>,
    /// The local lease deadline, in nanoseconds after [`base`]: see
    /// [`JobContext::lease_deadline`].
    deadline: AtomicU64,
    /// The handler has returned and the attempt's ending is being written: a renewal
    /// that misses the job now is the ending landing, not a lost lease.
    ending: AtomicBool,
    /// Whether the handler started, and whether a renewal recorded that in the row
    /// (`NOT_STARTED`, `STARTED`, `START_RECORDED`): an expired lease counts as an
    /// attempt only once its start is recorded (see migrations/0015_recorded_starts.sql).
    start: AtomicU8,
    /// This process claimed the same attempt (job, generation, identity) again, so this
    /// one no longer holds its job: see [`JobContext::supersede`].
    superseded: AtomicBool,
    /// The superseded attempt's slot in the queue limits is still counted (see
    /// `Env::untrack`).
    superseded_counted: AtomicBool,
}

const NOT_STARTED: u8 = 0;
const STARTED: u8 = 1;
const START_RECORDED: u8 = 2;

/// The origin of the monotonic deadlines kept as integers.
fn base() -> Instant {
    static BASE: OnceLock<Instant> = OnceLock::new();
    *BASE.get_or_init(Instant::now)
}

fn to_nanos(at: Instant) -> u64 {
    at.saturating_duration_since(base()).as_nanos() as u64
}

impl JobContext {
    /// A context for a claimed attempt whose lease is confirmed until `deadline` on
    /// this process's monotonic clock (see [`JobContext::lease_deadline`]).
    pub(crate) fn new(
        job: ClaimedJob,
        store: Store,
        effect_keep: Duration,
        deadline: Instant,
    ) -> Self {
        JobContext {
            inner: Arc::new(Inner {
                job,
                store,
                cancel: CancellationToken::new(),
                reason: Mutex::new(None),
                effect_keep,
                completed_in_tx: Mutex::new(false),
                deadline: AtomicU64::new(to_nanos(deadline)),
                ending: AtomicBool::new(false),
                start: AtomicU8::new(NOT_STARTED),
                superseded: AtomicBool::new(false),
                superseded_counted: AtomicBool::new(false),
            }),
        }
    }

    /// Until when this process may treat the attempt's lease as its own, on the
    /// monotonic clock: the send time of the latest renewal (or the claim) the database
    /// confirmed, plus the lease, less a margin (half the renew interval). Renewal moves
    /// it on; if it passes, the scheduler cancels the handler (`LeaseLost`) and stops it
    /// before the lease can expire in the database, where another process could claim
    /// the job — whether or not the database answered.
    pub fn lease_deadline(&self) -> Instant {
        base() + Duration::from_nanos(self.inner.deadline.load(SeqCst))
    }

    /// Time left before [`JobContext::lease_deadline`]; zero once it has passed.
    pub fn lease_remaining(&self) -> Duration {
        self.lease_deadline()
            .saturating_duration_since(Instant::now())
    }

    /// A renewal sent at some moment confirmed the lease: move the deadline on (never
    /// back).
    pub(crate) fn confirm_lease(&self, deadline: Instant) {
        self.inner.deadline.fetch_max(to_nanos(deadline), SeqCst);
    }

    /// The lease is the attempt's to use: not cancelled, deadline not passed.
    pub(crate) fn lease_live(&self) -> bool {
        !self.is_cancelled() && Instant::now() < self.lease_deadline()
    }

    /// The handler is about to be spawned.
    pub(crate) fn mark_started(&self) {
        let _ = self
            .inner
            .start
            .compare_exchange(NOT_STARTED, STARTED, SeqCst, SeqCst);
    }

    /// The handler was spawned (whether or not the row says so yet).
    pub(crate) fn has_started(&self) -> bool {
        self.inner.start.load(SeqCst) != NOT_STARTED
    }

    /// Started, and no renewal has recorded it in the row yet.
    pub(crate) fn start_unrecorded(&self) -> bool {
        self.inner.start.load(SeqCst) == STARTED
    }

    /// A renewal that said the attempt started was confirmed.
    pub(crate) fn start_recorded(&self) {
        let _ = self
            .inner
            .start
            .compare_exchange(STARTED, START_RECORDED, SeqCst, SeqCst);
    }

    pub(crate) fn set_ending(&self) {
        self.inner.ending.store(true, SeqCst);
    }

    /// The handler returned (or the job completed in the handler's own transaction):
    /// the job leaving the running state now is this attempt's own doing.
    pub(crate) fn is_ending(&self) -> bool {
        self.inner.ending.load(SeqCst) || self.completed_in_tx()
    }

    /// The job's id.
    pub fn job_id(&self) -> JobId {
        self.inner.job.id
    }
    /// The queue the job was claimed from.
    pub fn queue(&self) -> &str {
        &self.inner.job.queue
    }
    /// The job's kind (the handler's [`Handler::KIND`](crate::Handler::KIND)).
    pub fn kind(&self) -> &str {
        &self.inner.job.kind
    }
    /// The job's ordering key; `None` for an unkeyed job.
    pub fn key(&self) -> Option<&str> {
        self.inner.job.key.as_deref()
    }
    /// 1 for the first attempt.
    pub fn attempt(&self) -> i32 {
        self.inner.job.attempt
    }
    /// Attempts the job gets: when [`JobContext::attempt`] equals it, a retryable error
    /// makes the job dead all the same.
    pub fn max_attempts(&self) -> i32 {
        self.inner.job.max_attempts
    }
    /// The job's generation: +1 on every claim of this job. A fencing token for a store
    /// that fences per job. For a store that fences per resource (an account), use
    /// [`JobContext::fencing_token`]: the generation starts again at 1 for each job.
    pub fn generation(&self) -> Generation {
        self.inner.job.generation
    }

    /// A fencing token that grows across every attempt of every job of this job's key,
    /// and of this job: the time of the attempt's claim, in microseconds since the Unix
    /// epoch, by the database clock. Jobs of one key run one at a time, each claimed
    /// after the one before it ended, so an effect store that fences per account
    /// (refusing a token older than the newest it has seen for the account) never
    /// refuses the account's current attempt, and always refuses a stale one. Being a
    /// time, it keeps growing where a counter would start again: in a schema created
    /// again, restored from an older dump, or beside another schema whose jobs use the
    /// same account. It relies on the database clock not going back by more than an
    /// attempt lasts (keep the servers' clocks synchronized, as a failover to a standby
    /// whose clock is behind could otherwise give the first attempts after it older
    /// tokens); [`JobContext::generation`] is a counter, for a store that fences per job.
    pub fn fencing_token(&self) -> u64 {
        self.inner.job.fencing_token()
    }
    /// This attempt's fence, for calling the [`Store`]'s fenced writes directly.
    pub fn fence(&self) -> Fence {
        self.inner.job.fence()
    }
    /// Everything the claim returned about the job (payload as JSON, timestamps, ...).
    pub fn job(&self) -> &ClaimedJob {
        &self.inner.job
    }

    /// Resolves when the attempt should stop (lost lease, shutdown, timeout, an
    /// operator's cancel); [`JobContext::cancel_reason`] says which.
    pub async fn cancelled(&self) {
        self.inner.cancel.cancelled().await
    }
    /// True once the attempt should stop; check it between steps of a long handler.
    pub fn is_cancelled(&self) -> bool {
        self.inner.cancel.is_cancelled()
    }
    /// Why the attempt was asked to stop; `None` while it was not.
    pub fn cancel_reason(&self) -> Option<CancelReason> {
        *self.inner.reason.lock().unwrap()
    }

    /// This process claimed this very attempt again (the same job, generation and
    /// identity: the job's row went back to an earlier state under the running process,
    /// a schema restored from an older dump): the database cannot tell the two apart, so
    /// this older one stops as if its lease were lost and writes nothing more. Its
    /// handler is told to stop; its ending, its completion in a transaction, its progress
    /// and its effect records are refused here, before any statement.
    pub(crate) fn supersede(&self) {
        self.inner.superseded_counted.store(true, SeqCst);
        self.inner.superseded.store(true, SeqCst);
        self.cancel(CancelReason::LeaseLost);
    }

    pub(crate) fn is_superseded(&self) -> bool {
        self.inner.superseded.load(SeqCst)
    }

    /// True once, for a superseded attempt whose queue-limit slot is still counted.
    pub(crate) fn take_superseded_count(&self) -> bool {
        self.inner.superseded_counted.swap(false, SeqCst)
    }

    /// Whether `other` is this very context (not only the same attempt's fence).
    pub(crate) fn same_context(&self, other: &JobContext) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    fn refuse_if_superseded(&self, what: &str) -> Result<(), JobError> {
        if self.is_superseded() {
            return Err(JobError::retry(format!(
                "{what} refused: this process claimed job {} again at the same generation \
                 (its row went back to an earlier state), so this older attempt no longer holds it",
                self.inner.job.id
            )));
        }
        Ok(())
    }

    pub(crate) fn cancel(&self, reason: CancelReason) {
        self.inner.reason.lock().unwrap().get_or_insert(reason);
        self.inner.cancel.cancel();
    }

    pub(crate) fn token(&self) -> CancellationToken {
        self.inner.cancel.clone()
    }

    pub(crate) fn completed_in_tx(&self) -> bool {
        *self.inner.completed_in_tx.lock().unwrap()
    }

    /// The stable key of this job's effect `step` (see [`EffectKey`]): made from what
    /// the claim returned, with no round trip.
    pub fn effect_key(&self, step: &str) -> EffectKey {
        EffectKey::new(&self.inner.job.effect_identity, self.inner.job.id, step)
    }

    /// Complete the job inside the handler's own transaction, together with its
    /// business writes: commit both or neither. Returns `Stale` if this attempt lost
    /// its fence — then roll back. After `Completed`, commit, and return `Ok` from the
    /// handler; the scheduler will not complete the job a second time. Once the commit
    /// is done the job is done, whatever the handler does next: an error, a panic or a
    /// stop after it is logged as after the completion, and the attempt ends completed
    /// (not stale, and not failed). Without the commit, the handler's ending decides.
    ///
    /// The job is done when your transaction commits, and its key's next job may start
    /// from that moment (on any process): do no more work for this job after the commit.
    /// A keyed job's key row stays locked until then, so keep the transaction short.
    ///
    /// `result` is stored as the job's result; the handler's own `Ok` output is then
    /// not stored. An error (the database failed the write) is retryable: roll back and
    /// return it. A result that cannot be stored or read back (see
    /// [`Store::complete_in`]) is a permanent error, refused before anything is sent:
    /// your transaction is still usable.
    ///
    /// ```no_run
    /// use leasehold::{CompleteOutcome, Handler, JobContext, JobError};
    /// use serde::{Deserialize, Serialize};
    ///
    /// #[derive(Serialize, Deserialize)]
    /// struct Fulfil {
    ///     order_id: i64,
    /// }
    ///
    /// /// Marks the order fulfilled and completes the job in the same transaction.
    /// struct FulfilOrder {
    ///     pool: sqlx::PgPool,
    /// }
    ///
    /// impl Handler for FulfilOrder {
    ///     type Payload = Fulfil;
    ///     type Output = ();
    ///     const KIND: &'static str = "fulfil_order";
    ///
    ///     async fn run(&self, ctx: JobContext, f: Fulfil) -> Result<(), JobError> {
    ///         let mut tx = self.pool.begin().await?;
    ///         sqlx::query("UPDATE orders SET status = 'fulfilled' WHERE id = $1")
    ///             .bind(f.order_id)
    ///             .execute(&mut *tx)
    ///             .await?;
    ///         let result = serde_json::json!({ "order_id": f.order_id });
    ///         match ctx.complete_in(&mut tx, Some(result)).await? {
    ///             CompleteOutcome::Completed => {
    ///                 tx.commit().await?; // the order and the job's end, or neither
    ///                 Ok(())
    ///             }
    ///             CompleteOutcome::Stale => {
    ///                 // Another attempt owns the job now and will fulfil the order.
    ///                 tx.rollback().await?;
    ///                 Err(JobError::retry("lost the lease before fulfilling"))
    ///             }
    ///             CompleteOutcome::AlreadyCompleted { .. } => {
    ///                 // This attempt's completion committed before: nothing to add.
    ///                 tx.rollback().await?;
    ///                 Ok(())
    ///             }
    ///         }
    ///     }
    /// }
    /// ```
    pub async fn complete_in(
        &self,
        conn: &mut PgConnection,
        result: Option<serde_json::Value>,
    ) -> Result<CompleteOutcome, JobError> {
        if self.is_superseded() {
            return Ok(CompleteOutcome::Stale);
        }
        let outcome = self
            .inner
            .store
            .complete_in(conn, &self.fence(), result)
            .await
            .map_err(|e| match e {
                crate::Error::InvalidInput { .. } => {
                    JobError::permanent(format!("completion in transaction refused: {e}"))
                }
                e => JobError::retry(format!("completion in transaction failed: {e}")),
            })?;
        if outcome == CompleteOutcome::Completed {
            *self.inner.completed_in_tx.lock().unwrap() = true;
        }
        Ok(outcome)
    }

    /// Enqueue a follow-up job (in its own transaction), through the scheduler running
    /// this attempt: a kind registered there gets its [`KindPolicy`](crate::KindPolicy)
    /// attempts and priority where the job sets none, as an enqueue through the
    /// [`Scheduler`](crate::Scheduler) does; any other kind gets the scheduler's defaults.
    /// A job without a queue goes to the store's default queue, as with
    /// [`Store::enqueue`].
    pub async fn enqueue(&self, job: NewJob) -> crate::Result<JobId> {
        self.inner.store.enqueue(job).await
    }

    /// [`JobContext::enqueue`] inside the caller's transaction, e.g. the one that
    /// completes this job ([`JobContext::complete_in`]): the follow-up exists exactly
    /// when the completion does.
    pub async fn enqueue_in(&self, conn: &mut PgConnection, job: NewJob) -> crate::Result<JobId> {
        self.inner.store.enqueue_in(conn, job).await
    }

    /// Run an effect at most once per effect key (see the module docs).
    ///
    /// `request` is what the effect is asked to do; its SHA-256 is bound to the key, so
    /// the same key with another request is refused (never replayed as if it matched).
    /// `act` receives the effect key to pass to the external store as its idempotency
    /// key; [`JobContext::fencing_token`] (or [`JobContext::generation`]) is the fencing
    /// token. `act` runs only while the lease is live, and its `Ok` outcome is recorded
    /// (fenced) before `once` returns it. If the lease was lost meanwhile, the result
    /// is a retryable error and the next attempt finds the effect by its key.
    ///
    /// Errors: `act`'s own error (nothing recorded, so a retry acts again, with the
    /// same key); a request whose fingerprint differs from the recorded one
    /// ([`crate::Error::FingerprintMismatch`], permanent); a ledger that cannot be read
    /// or written (retryable).
    ///
    /// Permanent, so that no retry acts again: a step whose key the ledger could not
    /// record (empty, with a NUL, or an effect key over
    /// [`INDEXED_TEXT_ALWAYS_FITS`](crate::store::INDEXED_TEXT_ALWAYS_FITS) bytes),
    /// refused before `act` runs; an outcome the ledger cannot store or a later attempt
    /// could not read back (a NUL, nesting deeper than
    /// [`MAX_PAYLOAD_DEPTH`](crate::store::MAX_PAYLOAD_DEPTH), more than
    /// [`StoreOptions::max_result_bytes`](crate::StoreOptions::max_result_bytes)),
    /// checked as soon as `act` returns and before it is recorded or returned: the effect
    /// happened once, and the job stops there with the reason for an operator to
    /// reconcile by its key; and a recorded outcome that cannot be decoded.
    ///
    /// ```no_run
    /// use leasehold::{Handler, JobContext, JobError};
    /// use serde::{Deserialize, Serialize};
    ///
    /// #[derive(Serialize, Deserialize)]
    /// struct Charge {
    ///     account: String,
    ///     cents: i64,
    /// }
    ///
    /// #[derive(Serialize, Deserialize)]
    /// struct Receipt {
    ///     charge_id: String,
    /// }
    ///
    /// struct ChargeCard;
    ///
    /// impl Handler for ChargeCard {
    ///     type Payload = Charge;
    ///     type Output = Receipt;
    ///     const KIND: &'static str = "charge_card";
    ///
    ///     async fn run(&self, ctx: JobContext, charge: Charge) -> Result<Receipt, JobError> {
    ///         let token = ctx.fencing_token();
    ///         let request = &charge;
    ///         // A later attempt (after a crash, a stall, a lost reply) gets the recorded
    ///         // receipt back instead of charging again.
    ///         ctx.once("charge", request, |key| async move {
    ///             // `key` is "<job's effect identity>/<job id>/charge" on every attempt:
    ///             // the gateway's idempotency key, so it cannot apply the charge twice
    ///             // either, and no other job has it.
    ///             gateway_charge(key.as_str(), token, request).await
    ///         })
    ///         .await
    ///     }
    /// }
    ///
    /// // Your payment gateway's client.
    /// async fn gateway_charge(
    ///     idempotency_key: &str,
    ///     fencing_token: u64,
    ///     charge: &Charge,
    /// ) -> Result<Receipt, JobError> {
    ///     // Send both; a refusal of a stale token is a retryable error.
    /// #   let _ = (fencing_token, &charge.account, charge.cents);
    /// #   Ok(Receipt { charge_id: format!("ch_{idempotency_key}") })
    /// }
    /// ```
    pub async fn once<Req, Out, F, Fut>(
        &self,
        step: &str,
        request: &Req,
        act: F,
    ) -> Result<Out, JobError>
    where
        Req: Serialize,
        Out: Serialize + DeserializeOwned,
        F: FnOnce(EffectKey) -> Fut,
        Fut: Future<Output = Result<Out, JobError>>,
    {
        self.once_reconciled(step, request, |_| async { Ok(None) }, act)
            .await
    }

    /// Record how far this attempt got (a counter, a cursor to resume from, a status
    /// line: at most [`MAX_PROGRESS_BYTES`](crate::store::MAX_PROGRESS_BYTES) of JSON) on
    /// the job, for operators (`leasehold job`, [`Store::job`]) and for the next attempt
    /// (which reads it from [`Store::job`] to resume). Replaces what was recorded before.
    /// Fenced: once this attempt lost its lease, nothing is written and
    /// [`FenceOutcome::Stale`](crate::FenceOutcome::Stale) comes back.
    ///
    /// ```no_run
    /// # async fn demo(ctx: leasehold::JobContext) -> Result<(), leasehold::JobError> {
    /// for (done, batch) in [10, 20, 30].iter().enumerate() {
    ///     // ... export `batch` ...
    /// #   let _ = batch;
    ///     ctx.record_progress(&serde_json::json!({ "batches_done": done + 1 })).await?;
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn record_progress(
        &self,
        progress: &impl Serialize,
    ) -> Result<crate::FenceOutcome, JobError> {
        if self.is_superseded() {
            return Ok(crate::FenceOutcome::Stale);
        }
        let value = crate::store::to_json(progress)
            .map_err(|e| JobError::permanent(format!("progress cannot be encoded: {e}")))?;
        self.inner
            .store
            .record_progress(&self.fence(), &value)
            .await
            .map_err(|e| match e {
                crate::Error::InvalidInput { .. } => JobError::permanent(e),
                e => JobError::retry(e),
            })
    }

    /// [`JobContext::once`] for stores with neither idempotency keys nor fencing:
    /// before acting, `lookup` asks the store whether the effect with this key already
    /// happened; if it did, its outcome is recorded and returned without acting.
    pub async fn once_reconciled<Req, Out, L, LFut, F, Fut>(
        &self,
        step: &str,
        request: &Req,
        lookup: L,
        act: F,
    ) -> Result<Out, JobError>
    where
        Req: Serialize,
        Out: Serialize + DeserializeOwned,
        L: FnOnce(EffectKey) -> LFut,
        LFut: Future<Output = Result<Option<Out>, JobError>>,
        F: FnOnce(EffectKey) -> Fut,
        Fut: Future<Output = Result<Out, JobError>>,
    {
        let key = self.effect_key(step);
        // Before anything else: a key the ledger would refuse after the effect happened
        // would make the retry act again.
        crate::store::check_effect_key(key.as_str()).map_err(|e| {
            JobError::permanent(format!(
                "the effect key of step {:?} cannot be recorded, so the step was not run: {e}",
                shortened(step)
            ))
        })?;
        let fingerprint = fingerprint(request)?;
        if let Some(recorded) = self.recorded(&key, &fingerprint).await? {
            return Ok(recorded);
        }
        self.live_for(&key)?;
        let outcome = match lookup(key.clone()).await? {
            Some(found) => found,
            None => {
                self.live_for(&key)?;
                act(key.clone()).await?
            }
        };
        let value = readable_outcome(&key, &outcome)?;
        self.refuse_if_superseded(&format!("recording effect {key}"))?;
        let recorded = self
            .inner
            .store
            .record_effect_as_stored(
                &self.fence(),
                key.as_str(),
                &fingerprint,
                &value,
                self.inner.effect_keep,
            )
            .await
            .map_err(|e| match e {
                // Checked before writing: nothing was recorded, and a retry would get the
                // same outcome again (or act again), so stop here.
                crate::Error::InvalidInput { .. } => JobError::permanent(format!(
                    "effect {key} happened, but its outcome cannot be recorded ({e}); stopped \
                     here so that no retry acts again: reconcile it by its key"
                )),
                e => JobError::retry(format!(
                    "effect {key} happened but recording it failed: {e}"
                )),
            })?;
        match recorded {
            // What a retry would get: the outcome as the ledger holds it, decoded.
            (RecordOutcome::Recorded, Some(stored)) => decode_outcome(&key, stored),
            (RecordOutcome::Recorded, None) => Ok(outcome),
            (RecordOutcome::AlreadyRecorded(existing), _) => {
                check_fingerprint(&key, &existing.fingerprint, &fingerprint)?;
                decode_outcome(&key, existing.outcome)
            }
            (RecordOutcome::Stale, _) => Err(JobError::retry(format!(
                "lost the lease after effect {key}; the next attempt will find it by its key"
            ))),
        }
    }

    /// Never act without a live lease: not cancelled, and not past the local deadline
    /// (a process that was stopped, e.g. by SIGSTOP, may wake up with its lease taken
    /// over by another; it must not act before a renewal confirms it).
    fn live_for(&self, key: &EffectKey) -> Result<(), JobError> {
        if self.lease_live() {
            return Ok(());
        }
        Err(JobError::retry(format!(
            "attempt stopped before effect {key}: lease not confirmed, or cancelled ({:?})",
            self.cancel_reason()
        )))
    }

    /// The outcome recorded under `key`, read together with whether this attempt still
    /// runs the job: without a record, one that does not stops the step before it acts.
    async fn recorded<Out: DeserializeOwned>(
        &self,
        key: &EffectKey,
        fingerprint: &str,
    ) -> Result<Option<Out>, JobError> {
        let found = self
            .inner
            .store
            .effect_under(key.as_str(), &self.fence())
            .await
            .map_err(|e| match e {
                // A stored outcome no attempt can read: retrying would not help, and
                // acting without it could do the effect twice.
                crate::Error::Decode { .. } => JobError::permanent(format!(
                    "the recorded outcome of effect {key} cannot be read ({e}); not acting again"
                )),
                e => JobError::retry(format!("cannot read the effect ledger for {key}: {e}")),
            })?;
        match found {
            Lookup::Lost => Err(JobError::retry(format!(
                "this attempt no longer runs job {} (its lease was taken back, an operator \
                 cancelled it, or the job is gone), so effect {key} was not run",
                self.inner.job.id
            ))),
            Lookup::Absent => Ok(None),
            Lookup::Recorded(rec) => {
                check_fingerprint(key, &rec.fingerprint, fingerprint)?;
                decode_outcome(key, rec.outcome).map(Some)
            }
        }
    }
}

/// `outcome` as the JSON the ledger records, checked to read back as the same value: a
/// later attempt decodes the recorded JSON into `Out`, and gets that instead of acting.
/// An outcome that does not survive the trip (a NaN or an infinity, which JSON writes as
/// null; an integer past what a JSON number reads back as exactly; a map whose keys
/// clash once written) would make that retry fail to decode, or decode to another value,
/// so it is refused before anything is recorded: the effect happened, and the job stops
/// for an operator to reconcile it by its key rather than act again.
fn readable_outcome<Out: Serialize + DeserializeOwned>(
    key: &EffectKey,
    outcome: &Out,
) -> Result<serde_json::Value, JobError> {
    let unreadable = |why: String| {
        JobError::permanent(format!(
            "effect {key} happened, but its outcome cannot be recorded so that a retry reads \
             it back ({why}); stopped here so that no retry acts again: reconcile it by its key"
        ))
    };
    let value = crate::store::to_json(outcome).map_err(|e| unreadable(e.to_string()))?;
    // The text the database stores and a retry parses (numbers included: jsonb keeps
    // them exactly, and they come back through this same parser).
    let text = value.to_string();
    let reread: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| unreadable(e.to_string()))?;
    let decoded: Out = serde_json::from_value(reread.clone())
        .map_err(|e| unreadable(format!("it reads back as {}: {e}", shortened(&text))))?;
    let again = crate::store::to_json(&decoded).map_err(|e| unreadable(e.to_string()))?;
    if again != reread {
        return Err(unreadable(format!(
            "it reads back as another value: {} instead of {}",
            shortened(&again.to_string()),
            shortened(&text)
        )));
    }
    Ok(value)
}

/// `text` cut to its first 60 characters, for a message about a step name of any length.
fn shortened(text: &str) -> String {
    match text.char_indices().nth(60) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_string(),
    }
}

/// SHA-256 of the request's JSON, hex: what [`JobContext::once`] binds to an effect
/// key. The same request must serialize to the same bytes on every attempt, so avoid a
/// `HashMap` in it (its order varies between processes); a `BTreeMap` is stable.
pub fn fingerprint<Req: Serialize>(request: &Req) -> Result<String, JobError> {
    let bytes = serde_json::to_vec(request)
        .map_err(|e| JobError::permanent(format!("cannot encode effect request: {e}")))?;
    Ok(Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

fn check_fingerprint(key: &EffectKey, recorded: &str, ours: &str) -> Result<(), JobError> {
    if recorded != ours {
        return Err(JobError::permanent(crate::Error::FingerprintMismatch {
            key: key.to_string(),
        }));
    }
    Ok(())
}

fn decode_outcome<Out: DeserializeOwned>(
    key: &EffectKey,
    value: serde_json::Value,
) -> Result<Out, JobError> {
    serde_json::from_value(value)
        .map_err(|e| JobError::permanent(format!("recorded outcome of {key} does not decode: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_effect_key_is_identity_job_and_step_and_parses_back() {
        let id = EffectIdentity::parse("0b9f2c4e-5d1a-4e8b-9c3f-7a6d5e4b3c2a").unwrap();
        let key = EffectKey::new(&id, JobId(17), "charge/eu");
        assert_eq!(
            key.as_str(),
            "0b9f2c4e-5d1a-4e8b-9c3f-7a6d5e4b3c2a/17/charge/eu"
        );
        let back = EffectKey::parse(key.as_str()).unwrap();
        assert_eq!(back, key);
        assert_eq!(
            (back.identity(), back.job(), back.step()),
            (id.as_str(), JobId(17), "charge/eu")
        );
        for bad in [
            "17/charge",
            "0b9f2c4e-5d1a-4e8b-9c3f-7a6d5e4b3c2a/charge",
            "0b9f2c4e-5d1a-4e8b-9c3f-7a6d5e4b3c2a/017/charge",
            "0b9f2c4e-5d1a-4e8b-9c3f-7a6d5e4b3c2a/+17/charge",
            "0b9f2c4e-5d1a-4e8b-9c3f-7a6d5e4b3c2a17/charge",
            "not-an-identity-of-thirty-six-chars!/17/charge",
        ] {
            assert!(EffectKey::parse(bad).is_none(), "{bad:?}");
        }
    }
}
