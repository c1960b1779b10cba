//! Elections and semaphores on Redis: [`SlotBackend`] for [`RedisLock`]. See
//! [docs/election-semaphore.md](https://example.invalid/lockkit/blob/main/docs/election-semaphore.md),
//! "Redis".
//!
//! A slot is a lock key of a derived name, so the lock's machinery keeps it: the leadership of
//! election `N` is the lock key `P:lock:elect/N`, permit `k` of semaphore `N` the lock key
//! `P:lock:sem/N/k` (lock names cannot contain `/`: no collision). Their fence counters
//! (`P:fence:…`, never left below the server's `TIME` in µs) are the terms and permit tokens, the
//! connection's batched renewer renews them (one script per [`RENEW_BATCH`](crate::RENEW_BATCH)
//! leases per tick, whatever they are), and the keyspace-notification watch hears of a deleted
//! or evicted slot key as of a lock key. What slots add lives in this module's scripts:
//!
//! - `P:slots:K/N` (a hash, `K` = `elect` or `sem`): `n` (the N in force), `s{k}` (the record of
//!   slot `k`'s holder: `"OWNER TOKEN VERSION VALUE"`) and `w{ID}` (the value of a queued
//!   waiter, installed when a release hands it a slot);
//! - one waiters' queue per name, `P:queue:K/N`, in the lock's format (waiter IDs by arrival,
//!   each with its key `P:waiter:ID`), shared by a semaphore's N slots;
//! - the channel `P:events:K/N`, on which every grant, hand-off, proclaim and release
//!   `PUBLISH`es what changed with its token (`g SLOT TOKEN VERSION TTL_MS PREV VALUE`, `PREV`
//!   the counter the grant bumped, `-` for a proclaim or a confirmation,
//!   `r SLOT TOKEN`), in the script that makes the change.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use redis::Script;
use redis::aio::{PubSubSink, PubSubStream};
use tokio::time::Instant;

use lockkit_core::backend::{
    Backoff, LeaseOps, LockBackend, SlotBackend, SlotGrant, SlotKind, SlotOps, SlotRequest,
    SlotWatch, TrackerHandle, WatchEvent, retry_transient, validate_slot_name, wait_deadline,
};
use lockkit_core::{
    AcquireOptions, Error, FencingToken, LeaseState, Result, SlotGuarantees, SlotHolder,
    SlotHolders, Wait,
};

use crate::conn::Conn;
use crate::core::ttl_millis;
use crate::core::{
    Call, Cleanup, Keys, RedisLease, Registration, Subscription, Woken, cancel_horizon,
    compare_and_pexpire, holds,
};
use crate::error::{BACKEND, bad_reply, from_redis};
use crate::lock::{RedisLock, WAITER_TTL, fallback_delay, wait_turn};
use crate::waiters::Waiting;

/// The longest an election observer goes without reading the slots itself, when no event
/// arrives: 3 s. Reads also come right after a holder's expected expiry (its TTL from the
/// last event or read, plus up to 30 ms), since an expiry publishes nothing.
pub const MAX_OBSERVE_POLL: Duration = Duration::from_secs(3);

/// How long after a read that found changes not yet delivered on the events channel an
/// observer reads again; if they still have not arrived then, it emits `Missed` and takes the
/// read as the state: 250 ms.
const CATCH_UP: Duration = Duration::from_millis(250);

/// Lua shared by the slot scripts. `KEYS[1]` the name's hash `P:slots:K/N`, `KEYS[2]` its
/// queue; `ARGV[1]` the lock-key base, `ARGV[2]` the fence-key base (for an election the keys
/// themselves; for a semaphore `P:lock:sem/N/`, to which the slot number is appended),
/// `ARGV[3]` the waiter-key prefix, `ARGV[4]` the events channel, `ARGV[5]` `1` for an
/// election, `ARGV[6]` N.
///
/// `bump(f)` makes a token as the lock does (`INCR`, never left below `TIME` in µs: a counter
/// restored from an older snapshot or replica must not hand out a lost token again).
/// `mint(k)` bumps slot `k`'s counter: the new token and `PREV`, the counter before the bump
/// (`-` if none). `write(k, id, ttl, value, t, p)` gives slot `k` to `id` with token `t`, writes
/// its record and publishes `g k TOKEN 0 TTL PREV VALUE`; `grant` is the two in a row.
/// `serve(k, me)` hands slot `k` to the first live waiter (up to `me`, which is removed, as the
/// lock's `serve`) and tells that waiter's client only (`"ID TOKEN"` on its channel, between
/// `mint` and `write`, by [`tell_lua`](crate::core::tell_lua)): a channel that nobody subscribes
/// to means the waiter's client is gone or reconnecting (as for the lock,
/// [`SERVE_LUA`](crate::core::SERVE_LUA)), so that waiter is dropped (its token skipped) and the
/// next one served; that grant's `PREV` is the counter before the first token skipped (no grant
/// came between, so observers see no gap). `free(k)` ends slot `k`'s holding: the
/// slot goes to the next live waiter, or is deleted with its record and `r k TOKEN` is
/// published.
const SLOT_LUA: &str = concat!(
    crate::core::tell_lua!(),
    r"
local function lk(k)
  if ARGV[5] == '1' then return ARGV[1] end
  return ARGV[1] .. k
end
local function fk(k)
  if ARGV[5] == '1' then return ARGV[2] end
  return ARGV[2] .. k
end
local function str(t) return string.format('%d', t) end
local function bump(f)
  local t = redis.call('INCR', f)
  local now = redis.call('TIME')
  local floor = tonumber(now[1]) * 1000000 + tonumber(now[2])
  if t < floor then
    t = floor
    redis.call('SET', f, str(t))
  end
  return t
end
local function mint(k)
  local p = redis.call('GET', fk(k)) or '-'
  return str(bump(fk(k))), p
end
local function write(k, id, ttl, value, t, p)
  redis.call('SET', lk(k), id, 'PX', ttl)
  redis.call('HSET', KEYS[1], 's' .. k, id .. ' ' .. t .. ' 0 ' .. value)
  redis.pcall('PUBLISH', ARGV[4], 'g ' .. k .. ' ' .. t .. ' 0 ' .. ttl .. ' ' .. p .. ' ' .. value)
end
local function grant(k, id, ttl, value)
  local t, p = mint(k)
  write(k, id, ttl, value, t, p)
  return t
end
local function serve(k, me)
  local prev
  while true do
    local h
    if me then
      h = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
      if not h then return false end
      redis.call('ZREM', KEYS[2], h)
      if h == me then
        redis.call('DEL', ARGV[3] .. me)
        redis.call('HDEL', KEYS[1], 'w' .. me)
        return false
      end
    else
      h = redis.call('ZPOPMIN', KEYS[2])[1]
      if not h then return false end
    end
    local w = redis.call('GETDEL', ARGV[3] .. h)
    local v = redis.call('HGET', KEYS[1], 'w' .. h)
    redis.call('HDEL', KEYS[1], 'w' .. h)
    local ttl, ch
    if w then ttl, ch = string.match(w, '^(%d+) %d+ (.*)$') end
    if ttl then
      local t, p = mint(k)
      -- PREV is the counter before the first waiter passed over: no grant came between.
      prev = prev or p
      -- Nobody is subscribed to the waiter's channel: its client is gone (or reconnecting,
      -- and looks again within MAX_WAIT_POLL): the next waiter is served instead.
      if tell(ch, h .. ' ' .. t) then
        write(k, h, ttl, v or '', t, prev)
        return h
      end
    end
  end
end
local function free(k)
  if not serve(k, false) then
    local t = redis.call('GET', fk(k)) or '0'
    redis.call('DEL', lk(k))
    redis.call('HDEL', KEYS[1], 's' .. k)
    redis.pcall('PUBLISH', ARGV[4], 'r ' .. k .. ' ' .. t)
  end
end
"
);

/// The slot acquire script (with [`SLOT_LUA`]). `KEYS[3]` the waiter ID's tombstone;
/// `ARGV[7]` the waiter ID (the grant's owner value), `ARGV[8]` TTL in ms, `ARGV[9]` the
/// client's hand-off channel (`''`: do not queue), `ARGV[10]` [`WAITER_TTL`] in ms, `ARGV[11]`
/// the value.
///
/// - Tombstone: `{2, 0, ''}`, nothing touched.
/// - Another N in force (`n` differs while a slot of the stored N is held or a live waiter
///   other than us queues): `{3, N in force, ''}`, nothing changed. No `n` on a semaphore
///   used before (slot 0's fence counter exists: its hash was deleted or evicted) while any
///   slot `0..MAX_PERMITS` is held or a live waiter other than us queues: `{3, 0, ''}` (the N
///   in force is unknown; the semaphore takes a new N once idle; the scan costs ~1 ms of
///   server time). Otherwise `n` becomes N.
/// - A slot holding our ID (a release handed it to us): its TTL is set anew from now, we leave
///   the queue, `{1, slot, token}`. If it has no record of ours (it was handed on by the lock's
///   own release script, for a lease given back as lapsed) the record is written and the grant
///   published now.
/// - Free slots: each goes to the first live waiter queued before us; the first one left is
///   ours: `{1, slot, token}`.
/// - Else, with a channel, we join the queue's tail (or keep our place) and store our value;
///   `{0, the shortest PTTL of the held slots, '0' if no live waiter queues before us}` (dead
///   waiters before us are dropped on the way).
static ACQUIRE_SLOT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"{SLOT_LUA}
if redis.call('EXISTS', KEYS[3]) == 1 then
  return {{2, 0, ''}}
end
local me, n = ARGV[7], tonumber(ARGV[6])
local stored = tonumber(redis.call('HGET', KEYS[1], 'n'))
if stored ~= n then
  if stored then
    for k = 0, stored - 1 do
      if redis.call('EXISTS', lk(k)) == 1 then return {{3, stored, ''}} end
    end
    for _, h in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
      if h ~= me then
        if redis.call('EXISTS', ARGV[3] .. h) == 1 then return {{3, stored, ''}} end
        redis.call('ZREM', KEYS[2], h)
        redis.call('HDEL', KEYS[1], 'w' .. h)
      end
    end
  elseif ARGV[5] ~= '1' and redis.call('EXISTS', fk(0)) == 1 then
    for k = 0, {max} - 1 do
      if redis.call('EXISTS', lk(k)) == 1 then return {{3, 0, ''}} end
    end
    for _, h in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
      if h ~= me and redis.call('EXISTS', ARGV[3] .. h) == 1 then return {{3, 0, ''}} end
    end
  end
  redis.call('HSET', KEYS[1], 'n', ARGV[6])
end
local open = {{}}
local pttl = -1
local function shorter(p)
  if pttl < 0 or (p >= 0 and p < pttl) then pttl = p end
end
for k = 0, n - 1 do
  local h = redis.call('GET', lk(k))
  if h == me then
    redis.call('PEXPIRE', lk(k), ARGV[8])
    local t = redis.call('GET', fk(k)) or '0'
    local rec = redis.call('HGET', KEYS[1], 's' .. k)
    if not rec or string.sub(rec, 1, #me + 1) ~= me .. ' ' then
      redis.call('HSET', KEYS[1], 's' .. k, me .. ' ' .. t .. ' 0 ' .. ARGV[11])
      redis.pcall('PUBLISH', ARGV[4], 'g ' .. k .. ' ' .. t .. ' 0 ' .. ARGV[8] .. ' - ' .. ARGV[11])
    end
    redis.call('ZREM', KEYS[2], me)
    redis.call('DEL', ARGV[3] .. me)
    redis.call('HDEL', KEYS[1], 'w' .. me)
    return {{1, k, t}}
  elseif not h then
    open[#open + 1] = k
  else
    shorter(redis.call('PTTL', lk(k)))
  end
end
for _, k in ipairs(open) do
  if not serve(k, me) then
    local ok, t = pcall(grant, k, me, ARGV[8], ARGV[11])
    if not ok then
      return redis.error_reply('lockkit: the fence counter is not an integer')
    end
    return {{1, k, t}}
  end
  shorter(redis.call('PTTL', lk(k)))
end
if ARGV[9] ~= '' then
  local now = redis.call('TIME')
  redis.call('ZADD', KEYS[2], 'NX', tonumber(now[1]) * 1000000 + tonumber(now[2]), me)
  redis.call('SET', ARGV[3] .. me, ARGV[8] .. ' 0 ' .. ARGV[9], 'PX', ARGV[10])
  redis.call('HSET', KEYS[1], 'w' .. me, ARGV[11])
end
local first = ''
for _, h in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  if h == me then
    first = '0'
    break
  end
  if redis.call('EXISTS', ARGV[3] .. h) == 1 then break end
  redis.call('ZREM', KEYS[2], h)
  redis.call('HDEL', KEYS[1], 'w' .. h)
end
return {{0, pttl, first}}
",
        max = lockkit_core::MAX_PERMITS
    ))
});

/// Compare-and-delete of a slot, handing it to the next live waiter ([`SLOT_LUA`]'s `free`).
/// `ARGV[7]` owner value, `ARGV[8]` slot. Returns 1 if the slot held our value (its `GET` is a
/// `pcall`: a slot key of another type is not ours).
static RELEASE_SLOT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"{SLOT_LUA}
if redis.pcall('GET', lk(ARGV[8])) ~= ARGV[7] then
  return 0
end
free(ARGV[8])
return 1
"
    ))
});

/// Cleanup of a slot acquire that was cancelled, timed out or failed, for its waiter ID (as
/// the lock's): `KEYS[3]` the ID's tombstone; `ARGV[7]` the ID, `ARGV[8]` tombstone TTL in ms.
/// Leaves the tombstone, takes the ID out of the queue (with its waiter key and value), and
/// frees a slot the ID holds (handing it on). Returns 1 if it held one.
static CANCEL_SLOT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"{SLOT_LUA}
redis.call('SET', KEYS[3], '1', 'PX', ARGV[8])
redis.call('ZREM', KEYS[2], ARGV[7])
redis.call('DEL', ARGV[3] .. ARGV[7])
redis.call('HDEL', KEYS[1], 'w' .. ARGV[7])
for k = 0, tonumber(ARGV[6]) - 1 do
  if redis.pcall('GET', lk(k)) == ARGV[7] then
    free(k)
    return 1
  end
end
return 0
"
    ))
});

/// Proclaim: replaces the value of slot `ARGV[8]` if its lock key holds `ARGV[7]`, bumps the
/// record's version and publishes `g SLOT TOKEN VERSION PTTL - VALUE`. `ARGV[9]` the value.
/// Returns 1, or 0 (nothing changed) if the slot is not ours.
static PROCLAIM: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"{SLOT_LUA}
local k, me = ARGV[8], ARGV[7]
if redis.pcall('GET', lk(k)) ~= me then
  return 0
end
local t, ver
local rec = redis.call('HGET', KEYS[1], 's' .. k)
if rec then
  local o, rt, rv = string.match(rec, '^(%S+) (%d+) (%d+) ')
  if o == me then t, ver = rt, tonumber(rv) end
end
if not t then t, ver = redis.call('GET', fk(k)) or '0', 0 end
ver = str(ver + 1)
redis.call('HSET', KEYS[1], 's' .. k, me .. ' ' .. t .. ' ' .. ver .. ' ' .. ARGV[9])
redis.pcall('PUBLISH', ARGV[4], 'g ' .. k .. ' ' .. t .. ' ' .. ver .. ' ' ..
  str(redis.call('PTTL', lk(k))) .. ' - ' .. ARGV[9])
return 1
"
    ))
});

/// The read: `{}` for a name never used, else `N, LIVE_WAITER ('1' or '0')` and six strings per
/// slot `0..N`: its fence counter (`''` if none), `'1'` if held (else `''` and four empty
/// strings), the holder's token, value version, `PTTL` and value. A held slot whose record is
/// not its holder's (handed on by the lock's own release script, not yet confirmed) reads with
/// the fence counter as token and the waiter's stored value.
static READ: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"{SLOT_LUA}
local n = redis.call('HGET', KEYS[1], 'n')
if not n then return {{}} end
local out = {{n, '0'}}
for _, h in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  if redis.call('EXISTS', ARGV[3] .. h) == 1 then
    out[2] = '1'
    break
  end
end
local function put(...)
  for _, v in ipairs({{...}}) do out[#out + 1] = v end
end
for k = 0, tonumber(n) - 1 do
  local f = redis.call('GET', fk(k)) or ''
  local h = redis.call('GET', lk(k))
  if h then
    local t, ver, val
    local rec = redis.call('HGET', KEYS[1], 's' .. k)
    if rec then
      local o, rt, rv, rval = string.match(rec, '^(%S+) (%d+) (%d+) (.*)$')
      if o == h then t, ver, val = rt, rv, rval end
    end
    if not t then
      t, ver, val = f, '0', redis.call('HGET', KEYS[1], 'w' .. h) or ''
    end
    put(f, '1', t, ver, str(redis.call('PTTL', lk(k))), val)
  else
    put(f, '', '', '', '', '')
  end
end
return out
"
    ))
});

/// The keys and channel of one election or semaphore.
#[derive(Debug, Clone)]
struct SlotKeys {
    kind: SlotKind,
    name: String,
    permits: u32,
    prefix: String,
    hash: String,
    queue: String,
    lock_base: String,
    fence_base: String,
    waiter_prefix: String,
    events: String,
    /// The lock keys of `kind`'s name, for tombstones.
    base: Keys,
}

impl SlotKeys {
    fn new(prefix: &str, kind: SlotKind, name: &str, permits: u32) -> Self {
        let whole = format!("{}/{name}", kind.as_str());
        let base = Keys::new(prefix, &whole);
        let (lock_base, fence_base) = match kind {
            SlotKind::Semaphore => {
                let k = Keys::new(prefix, &format!("{whole}/"));
                (k.lock.clone(), k.fence.clone())
            }
            _ => (base.lock.clone(), base.fence.clone()),
        };
        Self {
            kind,
            name: name.to_owned(),
            permits,
            prefix: prefix.to_owned(),
            hash: format!("{prefix}:slots:{whole}"),
            queue: base.queue.clone(),
            lock_base,
            fence_base,
            waiter_prefix: base.waiter_prefix.clone(),
            events: format!("{prefix}:events:{whole}"),
            base,
        }
    }

    fn single(&self) -> bool {
        self.kind != SlotKind::Semaphore
    }

    /// The derived lock name of `slot`: `elect/N` or `sem/N/k`.
    fn slot_name(&self, slot: u32) -> String {
        match self.kind {
            SlotKind::Semaphore => format!("sem/{}/{slot}", self.name),
            _ => format!("{}/{}", self.kind.as_str(), self.name),
        }
    }

    /// The lock's keys of `slot`, with the name's shared queue.
    fn lock_keys(&self, slot: u32) -> Keys {
        Keys::new(&self.prefix, &self.slot_name(slot)).with_queue(self.queue.clone())
    }

    /// A script invocation with the common keys and arguments ([`SLOT_LUA`]).
    fn invocation<'a>(&self, script: &'a Script) -> redis::ScriptInvocation<'a> {
        let mut inv = script.prepare_invoke();
        inv.key(&self.hash)
            .key(&self.queue)
            .arg(&self.lock_base)
            .arg(&self.fence_base)
            .arg(&self.waiter_prefix)
            .arg(&self.events)
            .arg(if self.single() { "1" } else { "0" })
            .arg(self.permits);
        inv
    }
}

fn parse_u64(s: &[u8]) -> Option<u64> {
    std::str::from_utf8(s).ok()?.parse().ok()
}

impl RedisLock {
    /// The Redis key holding `slot` of election or semaphore `name` (its value is the holder's
    /// owner value, with the lease's TTL): `P:lock:elect/{name}` (any `slot`) or
    /// `P:lock:sem/{name}/{slot}`, for inspection and tests. Does not validate `name`.
    pub fn slot_key(&self, kind: SlotKind, name: &str, slot: u32) -> String {
        SlotKeys::new(self.prefix(), kind, name, 1)
            .lock_keys(slot)
            .lock
            .clone()
    }

    /// The pub/sub channel on which the changes of election or semaphore `name` are published
    /// (`P:events:elect/{name}`, `P:events:sem/{name}`), for inspection. Does not validate
    /// `name`.
    pub fn slot_events_channel(&self, kind: SlotKind, name: &str) -> String {
        SlotKeys::new(self.prefix(), kind, name, 1).events
    }

    /// Elections and semaphores build their keys without the Cluster mode's hash tag (their
    /// permits' keys and the `P:slots:` hash would land in different slots): refused there.
    ///
    /// # Errors
    /// [`Error::NotSupported`] in [`RedisMode::Cluster`](crate::RedisMode::Cluster).
    fn slots_supported(&self) -> Result<()> {
        if self.conn().is_cluster() {
            return Err(Error::NotSupported {
                operation: "an election or semaphore in Redis Cluster mode",
                backend: crate::error::BACKEND,
            });
        }
        Ok(())
    }

    fn slot_token(&self, keys: &SlotKeys, slot: u32, token: u64) -> FencingToken {
        FencingToken::new(self.lock_id(&keys.slot_name(slot)), token)
    }

    /// One run of the acquire script for the call's current waiter ID, queuing if `route` is
    /// this ID's hand-off route. Cancel safe as the lock's attempt: the call's guard cleans up.
    async fn slot_attempt(
        &self,
        call: &Call<Arc<SlotKeys>>,
        value: &[u8],
        ttl: Duration,
        route: Option<&Waiting>,
    ) -> Result<SlotAttempt> {
        let keys = &call.keys;
        let (me, queue) = {
            let mut st = call.lock();
            st.armed = true;
            let queue = route.filter(|w| w.id() == st.me).is_some();
            (st.me.clone(), queue)
        };
        let channel = if queue { self.hub().channel() } else { "" };
        let mut inv = keys.invocation(&ACQUIRE_SLOT);
        inv.key(keys.base.tombstone(&me))
            .arg(&me)
            .arg(ttl_millis(ttl))
            .arg(channel)
            .arg(ttl_millis(WAITER_TTL))
            .arg(value);
        let sent = Instant::now();
        let reply: (i64, i64, String) = match self.conn().invoke(&inv).await {
            Ok(r) => r,
            Err(e) => {
                call.retire(&me);
                return Err(from_redis(e));
            }
        };
        match reply {
            (1, slot, token) => {
                let (Ok(slot), Ok(token)) = (u32::try_from(slot), token.parse::<u64>()) else {
                    call.retire(&me);
                    return Err(bad_reply("slot acquire"));
                };
                let confirmed = self.confirm(&keys.lock_keys(slot), &me, ttl, None).await;
                if let Err(e) = confirmed {
                    // Not replicated: give the slot back (the next waiter gets it).
                    if call.cancel_once(&me).await.is_ok() {
                        call.forget(&me);
                    } else {
                        call.retire(&me);
                    }
                    return Err(e);
                }
                let tracker = TrackerHandle::new(sent, ttl);
                if tracker.state() == LeaseState::Lost {
                    // Too late to be of use: give it back (in the background if this fails).
                    if call.cancel_once(&me).await.is_ok() {
                        call.forget(&me);
                    } else {
                        call.retire(&me);
                    }
                    return Err(Error::Unavailable {
                        backend: BACKEND,
                        source: format!(
                            "the grant arrived {:?} after the request, later than its TTL of \
                             {ttl:?}; it was given back",
                            sent.elapsed()
                        )
                        .into(),
                    });
                }
                Ok(SlotAttempt::Granted {
                    slot,
                    token,
                    owner: call.granted(),
                    tracker,
                })
            }
            (0, pttl, first) => {
                let mut st = call.lock();
                st.queued |= queue;
                st.armed = st.queued;
                Ok(SlotAttempt::Held {
                    pttl: u64::try_from(pttl).ok().map(Duration::from_millis),
                    first: first == "0",
                })
            }
            (3, theirs, _) => {
                let mut st = call.lock();
                st.armed = st.queued;
                Ok(SlotAttempt::Mismatch(
                    u32::try_from(theirs).map_err(|_| bad_reply("slot acquire"))?,
                ))
            }
            _ => {
                // A tombstone for our current ID (it cannot be ours) or an unknown reply.
                call.retire(&me);
                Err(bad_reply("slot acquire"))
            }
        }
    }

    /// The grant of `slot` to `owner`, renewed by this connection's batch and watched for
    /// losses as a lock lease.
    fn slot_grant(
        &self,
        keys: &Arc<SlotKeys>,
        slot: u32,
        owner: String,
        token: u64,
        tracker: TrackerHandle,
        opts: &AcquireOptions,
    ) -> SlotGrant {
        let inner = Arc::new(RedisLease {
            conn: self.conn().clone(),
            name: keys.name.clone(),
            keys: keys.lock_keys(slot),
            owner,
            batch: Mutex::new(None),
            watched: Mutex::new(None),
            self_renewing: opts.keepalive,
            delay: None,
        });
        let watched = self.hub().watch().register(&inner, &tracker);
        *inner.watched.lock().unwrap_or_else(|p| p.into_inner()) = Some(Box::new(watched));
        if opts.keepalive {
            let batch = self.renewer().register(Arc::downgrade(&inner), &tracker);
            if batch.is_none() {
                tracing::warn!(name = %keys.name, "no Tokio runtime: the slot will not be kept alive");
            }
            *inner.batch.lock().unwrap_or_else(|p| p.into_inner()) =
                batch.map(|b| Box::new(b) as Registration);
        }
        let ops = Arc::new(RedisSlotLease {
            inner,
            keys: keys.clone(),
            slot,
        });
        let lease = lockkit_core::Lease::new(
            keys.name.as_str(),
            self.slot_token(keys, slot, token),
            tracker,
            ops.clone(),
            opts,
        );
        SlotGrant::new(lease, slot, ops)
    }

    /// Reads the slots of `keys`' name (the [`READ`] script).
    async fn read_slots(&self, keys: &SlotKeys) -> Result<Option<SlotRead>> {
        let reply: Vec<Vec<u8>> = self
            .conn()
            .invoke(&keys.invocation(&READ))
            .await
            .map_err(from_redis)?;
        SlotRead::parse(&reply)
    }
}

/// A held slot as [`READ`] found it: token, value version, `PTTL`, value.
type ReadHolder = (u64, u64, Option<Duration>, Vec<u8>);

/// One slot as [`READ`] found it: its fence counter and its holder.
type ReadSlot = (Option<u64>, Option<ReadHolder>);

/// What [`READ`] found.
#[derive(Debug)]
struct SlotRead {
    permits: u32,
    waiting: bool,
    /// Per slot: the fence counter and the holder (token, version, PTTL, value).
    slots: Vec<ReadSlot>,
}

impl SlotRead {
    fn parse(reply: &[Vec<u8>]) -> Result<Option<Self>> {
        let bad = || bad_reply("slot read");
        let [n, waiting, rest @ ..] = reply else {
            return if reply.is_empty() {
                Ok(None)
            } else {
                Err(bad())
            };
        };
        let permits = parse_u64(n)
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(bad)?;
        if rest.len() != permits as usize * 6 {
            return Err(bad());
        }
        let mut slots = Vec::with_capacity(permits as usize);
        for s in rest.chunks(6) {
            let fence = parse_u64(&s[0]);
            let holder = if s[1].is_empty() {
                None
            } else {
                let token = parse_u64(&s[2]).ok_or_else(bad)?;
                let ver = parse_u64(&s[3]).ok_or_else(bad)?;
                let pttl = std::str::from_utf8(&s[4])
                    .ok()
                    .and_then(|p| p.parse::<i64>().ok())
                    .and_then(|p| u64::try_from(p).ok())
                    .map(Duration::from_millis);
                Some((token, ver, pttl, s[5].clone()))
            };
            slots.push((fence, holder));
        }
        Ok(Some(Self {
            permits,
            waiting: waiting.as_slice() == b"1",
            slots,
        }))
    }
}

enum SlotAttempt {
    Granted {
        slot: u32,
        token: u64,
        owner: String,
        tracker: TrackerHandle,
    },
    Held {
        pttl: Option<Duration>,
        /// No live waiter queues before us.
        first: bool,
    },
    Mismatch(u32),
}

/// The slot cleanup ([`CANCEL_SLOT`]) for a waiter ID, run by the acquire call's guard.
impl Cleanup for Arc<SlotKeys> {
    fn cancel_once<'a>(
        &'a self,
        conn: &'a Conn,
        id: &'a str,
        ttl: Duration,
    ) -> impl Future<Output = Result<bool>> + Send + 'a {
        cancel_once(conn, self, id, ttl)
    }

    fn label(&self) -> &str {
        &self.name
    }
}

async fn cancel_once(conn: &Conn, keys: &SlotKeys, id: &str, ttl: Duration) -> Result<bool> {
    let mut inv = keys.invocation(&CANCEL_SLOT);
    inv.key(keys.base.tombstone(id))
        .arg(id)
        .arg(ttl_millis(cancel_horizon(ttl)));
    match conn.invoke::<i64>(&inv).await.map_err(from_redis)? {
        1 => Ok(true),
        0 => Ok(false),
        _ => Err(bad_reply("slot cleanup")),
    }
}

/// A granted slot: the lock lease of its key (renewed and watched as a lock lease) plus what
/// slots add: release and cleanup hand the slot on with [`RELEASE_SLOT`] (which publishes the
/// change), and [`SlotOps::set_value`] proclaims.
struct RedisSlotLease {
    inner: Arc<RedisLease>,
    keys: Arc<SlotKeys>,
    slot: u32,
}

impl fmt::Debug for RedisSlotLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisSlotLease")
            .field("lease", &self.inner)
            .field("slot", &self.slot)
            .finish()
    }
}

impl RedisSlotLease {
    async fn release_slot(&self) -> Result<()> {
        // As the lock's release: out of the batch and the loss notices first.
        drop(
            self.inner
                .batch
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(),
        );
        drop(
            self.inner
                .watched
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(),
        );
        let mut inv = self.keys.invocation(&RELEASE_SLOT);
        inv.arg(&self.inner.owner).arg(self.slot);
        match self
            .inner
            .conn
            .invoke::<i64>(&inv)
            .await
            .map_err(from_redis)?
        {
            1 => Ok(()),
            0 => Err(self.inner.not_held()),
            _ => Err(bad_reply("slot release")),
        }
    }
}

#[async_trait]
impl LeaseOps for RedisSlotLease {
    async fn renew(&self, ttl: Duration) -> Result<()> {
        if compare_and_pexpire(
            &self.inner.conn,
            &self.inner.keys,
            &self.inner.owner,
            ttl,
            None,
        )
        .await?
        {
            Ok(())
        } else {
            Err(self.inner.not_held())
        }
    }

    async fn release(&self) -> Result<()> {
        self.release_slot().await
    }

    /// Slots have no lock-delay: giving one back as lapsed is a release.
    async fn relinquish(&self) -> Result<()> {
        self.release_slot().await
    }

    async fn check(&self) -> Result<()> {
        holds(&self.inner.conn, &self.inner.keys.lock, &self.inner.owner)
            .await?
            .then_some(())
            .ok_or_else(|| self.inner.not_held())
    }

    fn self_renewing(&self) -> bool {
        self.inner.self_renewing
    }

    /// The lock lease ([`RedisLease`]), so that [`RedisFence`](crate::RedisFence) takes it.
    fn as_any(&self) -> &dyn std::any::Any {
        self.inner.as_ref()
    }
}

#[async_trait]
impl SlotOps for RedisSlotLease {
    async fn set_value(&self, value: &[u8]) -> Result<()> {
        let mut inv = self.keys.invocation(&PROCLAIM);
        inv.arg(&self.inner.owner).arg(self.slot).arg(value);
        match self
            .inner
            .conn
            .invoke::<i64>(&inv)
            .await
            .map_err(from_redis)?
        {
            1 => Ok(()),
            0 => Err(self.inner.not_held()),
            _ => Err(bad_reply("proclaim")),
        }
    }
}

const NOTES: &str = "efficiency elections and semaphores on one Redis master (single node or \
Sentinel): each slot is a \
lock key of a derived name (elect/N, sem/N/k), with the lock's tokens, batched renewal, loss \
notices and FIFO hand-off. Observers read a pub/sub channel (at-most-once): Missed after a \
reconnect or where a read finds changes that no message delivered. A failover can elect twice.";

#[async_trait]
impl SlotBackend for RedisLock {
    /// Grants a slot: one script checks N, takes a free slot if no live waiter queues before
    /// us (or hands free slots to those who do), and otherwise queues a waiting acquire in the
    /// name's queue. A release hands the slot to the first live waiter and tells only that
    /// waiter's client (as the lock); the waiter then confirms with the same script (which
    /// finds the slot holding its ID, sets its TTL from now, and reports the slot). Waiters
    /// look again at least every [`MAX_WAIT_POLL`](crate::MAX_WAIT_POLL); the first in line also just after the
    /// shortest holder `PTTL` (an expiry is announced by nobody), so one waiter wakes per
    /// expiry.
    ///
    /// # Errors
    /// As [`Lock::acquire`](lockkit_core::Lock::acquire), plus [`Error::PermitsMismatch`].
    ///
    /// # Cancel safety
    /// Cancel safe, as the lock's acquire: a dropped, timed-out or failed call spawns a cleanup
    /// for its waiter ID that leaves the queue, frees (hands on) a slot it took or was handed,
    /// and leaves a tombstone against a late script of that ID.
    async fn grant_slot(&self, req: SlotRequest<'_>, opts: AcquireOptions) -> Result<SlotGrant> {
        self.slots_supported()?;
        validate_slot_name(req.kind, req.name)?;
        let start = Instant::now();
        let deadline = wait_deadline(opts.wait, start);
        let keys = Arc::new(SlotKeys::new(
            self.prefix(),
            req.kind,
            req.name,
            req.permits,
        ));
        let timeout = || Error::Timeout {
            name: req.name.to_owned(),
            waited: start.elapsed(),
        };
        let call = Call::new(self.conn().clone(), keys.clone(), opts.ttl);
        let hub = self.hub();
        let mut route: Option<Waiting> = None;
        let mut subscription = Subscription::new(start);
        loop {
            if opts.wait != Wait::No {
                let me = call.me();
                if route.as_ref().is_none_or(|r| r.is_dead() || r.id() != me) {
                    route = hub.register(&me);
                }
            }
            let attempt = retry_transient(&opts, deadline, || {
                self.slot_attempt(&call, req.value, opts.ttl, route.as_ref())
            })
            .await?;
            let (pttl, first) = match attempt {
                SlotAttempt::Granted {
                    slot,
                    token,
                    owner,
                    tracker,
                } => {
                    return Ok(self.slot_grant(&keys, slot, owner, token, tracker, &opts));
                }
                SlotAttempt::Mismatch(theirs) => {
                    call.clean_up_now().await;
                    return Err(Error::PermitsMismatch {
                        name: req.name.to_owned(),
                        ours: req.permits,
                        theirs,
                    });
                }
                SlotAttempt::Held { pttl, first } => {
                    // An earlier attempt of this call may have taken the slot after all: give
                    // it back and look again (never report our own slot as held).
                    if call.clean_up_retired().await {
                        continue;
                    }
                    (pttl, first)
                }
            };
            if opts.wait == Wait::No {
                return Err(Error::Held {
                    name: req.name.to_owned(),
                });
            }
            // The first in line looks just after the shortest holder TTL; the others keep
            // their place alive and are handed a slot by whoever frees it.
            let poll = fallback_delay(if first || route.is_none() { pttl } else { None });
            let woken = wait_turn(&mut subscription, hub, None, &mut route, poll, deadline).await;
            if let Woken::Deadline = woken {
                call.clean_up_now().await;
                return Err(timeout());
            }
        }
    }

    /// Reads the slots, their holders' records and `PTTL`s in one script.
    ///
    /// # Errors
    /// [`Error::InvalidName`]; transport errors.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads.
    async fn slot_holders(&self, kind: SlotKind, name: &str) -> Result<Option<SlotHolders>> {
        self.slots_supported()?;
        validate_slot_name(kind, name)?;
        let permits = if kind == SlotKind::Semaphore {
            lockkit_core::MAX_PERMITS
        } else {
            1
        };
        let keys = SlotKeys::new(self.prefix(), kind, name, permits);
        let Some(read) = self.read_slots(&keys).await? else {
            return Ok(None);
        };
        let mut holders = Vec::new();
        for (slot, (_, holder)) in (0u32..).zip(read.slots) {
            if let Some((token, _, pttl, value)) = holder {
                holders.push(SlotHolder::new(
                    slot,
                    self.slot_token(&keys, slot, token),
                    value,
                    pttl,
                ));
            }
        }
        if holders.is_empty() && !read.waiting {
            return Ok(None);
        }
        Ok(Some(SlotHolders::new(read.permits, holders)))
    }

    /// Subscribes to the name's events channel on a pub/sub connection of its own, then reads
    /// the slots (the first event). Each `g`/`r` message newer (by token, then value version)
    /// than what the watch knows is one event; reads just after a holder's expected expiry and
    /// at least every [`MAX_OBSERVE_POLL`] find what no message tells (an expiry, an admin's
    /// `DEL`). [`WatchEvent::Missed`] comes after every reconnect, for a grant whose previous
    /// token is not the last one known or a version more than one past the last one known,
    /// and when a read finds changes that no message delivered within 250 ms.
    ///
    /// # Errors
    /// [`Error::InvalidName`]; transport errors of the first connect, subscribe or read.
    ///
    /// # Cancel safety
    /// Cancel safe: a dropped call closes its connection.
    async fn watch_slots(&self, kind: SlotKind, name: &str) -> Result<Box<dyn SlotWatch>> {
        self.slots_supported()?;
        validate_slot_name(kind, name)?;
        let permits = if kind == SlotKind::Semaphore {
            lockkit_core::MAX_PERMITS
        } else {
            1
        };
        let mut watch = RedisSlotWatch {
            lock: self.clone(),
            keys: SlotKeys::new(self.prefix(), kind, name, permits),
            conn: None,
            slots: BTreeMap::new(),
            pending: VecDeque::new(),
            next_read: Instant::now() + MAX_OBSERVE_POLL,
            behind_since: None,
            started: false,
        };
        watch.resubscribe().await?;
        Ok(Box::new(watch))
    }

    fn slot_guarantees(&self) -> SlotGuarantees {
        let mut lock = LockBackend::guarantees(self);
        lock.lock_delay = false;
        let mut g = SlotGuarantees::new(lock);
        g.observe = true;
        g.every_change_observed = false;
        g.notes = NOTES;
        g
    }
}

/// What an observer knows of one slot.
#[derive(Debug, Default, Clone)]
struct SlotView {
    /// The highest token known to have been made for the slot.
    fence: Option<u64>,
    holder: Option<Held>,
}

#[derive(Debug, Clone)]
struct Held {
    token: u64,
    version: u64,
    value: Vec<u8>,
    /// When the holder's key expires unless renewed, as last heard.
    expires: Option<Instant>,
}

/// An election (or semaphore) observer: a pub/sub connection of its own subscribed to the
/// name's events channel, applying each `g`/`r` message that is newer (by token, then value
/// version) than what it knows; reads of the slots at (re)subscribe, just after the holders'
/// expected expiry and at least every [`MAX_OBSERVE_POLL`] find what no message tells (an
/// expiry, an admin's `DEL`). `Missed` after every resubscribe, for a grant whose previous
/// token (`PREV`) is not the last known one or a version more than one past the last known,
/// and for a read that finds changes no message delivered within [`CATCH_UP`].
struct RedisSlotWatch {
    lock: RedisLock,
    keys: SlotKeys,
    conn: Option<(PubSubSink, PubSubStream)>,
    slots: BTreeMap<u32, SlotView>,
    pending: VecDeque<WatchEvent>,
    next_read: Instant,
    /// A read found changes not yet delivered, at this time.
    behind_since: Option<Instant>,
    /// The first state was delivered (a resubscribe after it emits `Missed`).
    started: bool,
}

impl fmt::Debug for RedisSlotWatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisSlotWatch")
            .field("channel", &self.keys.events)
            .field("connected", &self.conn.is_some())
            .field("slots", &self.slots)
            .finish()
    }
}

impl RedisSlotWatch {
    fn snapshot(&self) -> Vec<SlotHolder> {
        self.slots
            .iter()
            .filter_map(|(slot, v)| {
                let h = v.holder.as_ref()?;
                Some(SlotHolder::new(
                    *slot,
                    self.lock.slot_token(&self.keys, *slot, h.token),
                    h.value.clone(),
                    None,
                ))
            })
            .collect()
    }

    fn emit(&mut self) {
        let s = self.snapshot();
        self.pending.push_back(WatchEvent::Holders(s));
    }

    fn missed(&mut self) {
        if self.pending.back() != Some(&WatchEvent::Missed) {
            self.pending.push_back(WatchEvent::Missed);
        }
    }

    /// Connects, subscribes, reads the state and queues it (after a `Missed` once started).
    /// Cancel safe: the state changes only once everything answered.
    async fn resubscribe(&mut self) -> Result<()> {
        self.conn = None;
        let hub = self.lock.hub();
        let pubsub = hub.open_pubsub().await?;
        let (mut sink, stream) = pubsub.split();
        let rt = hub.response_timeout();
        match tokio::time::timeout(rt, sink.subscribe(&self.keys.events)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(from_redis(e)),
            Err(_) => return Err(crate::error::timed_out("SUBSCRIBE", rt)),
        }
        let read = self.lock.read_slots(&self.keys).await?;
        if self.started {
            self.missed();
        }
        self.adopt(read);
        self.started = true;
        self.emit();
        self.conn = Some((sink, stream));
        Ok(())
    }

    /// Takes `read` as the state.
    fn adopt(&mut self, read: Option<SlotRead>) {
        let now = Instant::now();
        self.slots.clear();
        self.behind_since = None;
        if let Some(read) = read {
            for (slot, (fence, holder)) in (0u32..).zip(read.slots) {
                let holder = holder.map(|(token, version, pttl, value)| Held {
                    token,
                    version,
                    value,
                    expires: pttl.map(|p| now + p),
                });
                if fence.is_some() || holder.is_some() {
                    self.slots.insert(slot, SlotView { fence, holder });
                }
            }
        }
        self.schedule(now);
    }

    fn schedule(&mut self, now: Instant) {
        let jitter = Duration::from_millis(rand::random_range(5..=30));
        let expiry = self
            .slots
            .values()
            .filter_map(|v| v.holder.as_ref()?.expires)
            .min()
            .map(|e| e.max(now) + jitter);
        let cap = now + MAX_OBSERVE_POLL;
        self.next_read = expiry.map_or(cap, |e| e.min(cap));
        if self.behind_since.is_some() {
            self.next_read = self.next_read.min(now + CATCH_UP);
        }
    }

    /// Applies one events-channel message.
    fn on_message(&mut self, payload: &[u8]) {
        let mut parts = payload.splitn(7, |b| *b == b' ');
        let kind = parts.next();
        let (Some(slot), Some(token)) = (
            parts
                .next()
                .and_then(parse_u64)
                .and_then(|s| u32::try_from(s).ok()),
            parts.next().and_then(parse_u64),
        ) else {
            return;
        };
        let now = Instant::now();
        let view = self.slots.entry(slot).or_default();
        let mut missed = false;
        let changed = match kind {
            Some(b"g") => {
                let (Some(version), Some(ttl), Some(prev)) = (
                    parts.next().and_then(parse_u64),
                    parts
                        .next()
                        .and_then(|p| std::str::from_utf8(p).ok()?.parse::<i64>().ok()),
                    parts.next().map(parse_u64),
                ) else {
                    return;
                };
                let value = parts.next().unwrap_or_default().to_vec();
                let expires = u64::try_from(ttl)
                    .ok()
                    .map(|t| now + Duration::from_millis(t));
                match &mut view.holder {
                    Some(h) if h.token == token => {
                        if version > h.version {
                            missed = version > h.version + 1;
                            h.version = version;
                            h.value = value;
                            h.expires = expires;
                            true
                        } else {
                            false
                        }
                    }
                    _ if view.fence.is_some_and(|f| token <= f) => false,
                    _ => {
                        // Tokens jump (the `TIME` floor): a grant is the next one after the
                        // last known token if it says that token was the counter it bumped.
                        missed = version > 0 || view.fence.is_some_and(|f| prev != Some(f));
                        view.fence = Some(token);
                        view.holder = Some(Held {
                            token,
                            version,
                            value,
                            expires,
                        });
                        true
                    }
                }
            }
            Some(b"r") => match &view.holder {
                Some(h) if h.token == token => {
                    view.holder = None;
                    true
                }
                _ if view.fence.is_none_or(|f| token > f) => {
                    missed = true;
                    view.fence = Some(token);
                    view.holder = None;
                    true
                }
                _ => false,
            },
            _ => false,
        };
        if missed {
            self.missed();
        }
        if changed {
            self.emit();
            self.schedule(now);
        }
    }

    /// A periodic read: takes what it finds where it agrees with what the messages delivered
    /// (a holder gone without a message: expired or deleted); where it is ahead of them (their
    /// messages may still be on the way), reads again after [`CATCH_UP`], and if still ahead
    /// then, emits `Missed` and takes the read.
    fn reconcile(&mut self, read: Option<SlotRead>) {
        let now = Instant::now();
        let Some(read) = read else {
            if self.slots.values().any(|v| v.holder.is_some()) {
                self.missed();
                self.adopt(None);
                self.emit();
            } else {
                self.schedule(now);
            }
            return;
        };
        let ahead = (0u32..).zip(&read.slots).any(|(slot, (fence, holder))| {
            let known = self.slots.get(&slot);
            let known_fence = known.and_then(|v| v.fence);
            if fence.unwrap_or(0) > known_fence.unwrap_or(0) {
                return true;
            }
            match (holder, known.and_then(|v| v.holder.as_ref())) {
                (Some((t, ver, ..)), Some(h)) => *t != h.token || *ver > h.version,
                (Some(_), None) => true,
                _ => false,
            }
        });
        if ahead {
            match self.behind_since {
                Some(since) if now >= since + CATCH_UP => {
                    self.missed();
                    self.adopt(Some(read));
                    self.emit();
                }
                Some(_) => self.schedule(now),
                None => {
                    self.behind_since = Some(now);
                    self.schedule(now);
                }
            }
            return;
        }
        self.behind_since = None;
        let mut changed = false;
        for (slot, (_, holder)) in (0u32..).zip(read.slots) {
            let Some(view) = self.slots.get_mut(&slot) else {
                continue;
            };
            match (holder, &mut view.holder) {
                (None, Some(_)) => {
                    view.holder = None;
                    changed = true;
                }
                (Some((_, _, pttl, _)), Some(h)) => h.expires = pttl.map(|p| now + p),
                _ => {}
            }
        }
        if changed {
            self.emit();
        }
        self.schedule(now);
    }
}

#[async_trait]
impl SlotWatch for RedisSlotWatch {
    async fn next(&mut self) -> Result<WatchEvent> {
        let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
        loop {
            if let Some(e) = self.pending.pop_front() {
                return Ok(e);
            }
            let Some((_, stream)) = self.conn.as_mut() else {
                match self.resubscribe().await {
                    Ok(()) => backoff.reset(),
                    Err(e) if e.is_retryable() => {
                        tracing::debug!(error = %e, "observer: resubscribing failed; retrying");
                        tokio::time::sleep(backoff.next_delay()).await;
                    }
                    Err(e) => return Err(e),
                }
                continue;
            };
            let next_read = self.next_read;
            // Messages first: a read must not overtake messages that already arrived.
            tokio::select! {
                biased;
                msg = stream.next() => match msg {
                    Some(msg) => self.on_message(msg.get_payload_bytes()),
                    None => {
                        tracing::debug!(channel = %self.keys.events, "observer: the pub/sub connection is gone");
                        self.conn = None;
                    }
                },
                _ = tokio::time::sleep_until(next_read) => {
                    match self.lock.read_slots(&self.keys).await {
                        Ok(read) => self.reconcile(read),
                        Err(e) => {
                            tracing::debug!(error = %e, "observer: reading the slots failed");
                            self.next_read = Instant::now() + CATCH_UP;
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_keys_are_derived_lock_names() {
        let e = SlotKeys::new("app", SlotKind::Election, "x", 1);
        assert_eq!(e.lock_keys(0).lock, "app:lock:elect/x");
        assert_eq!(e.lock_keys(0).fence, "app:fence:elect/x");
        assert_eq!(e.queue, "app:queue:elect/x");
        assert_eq!(e.hash, "app:slots:elect/x");
        assert_eq!(e.events, "app:events:elect/x");
        let s = SlotKeys::new("app", SlotKind::Semaphore, "x", 3);
        assert_eq!(s.lock_keys(2).lock, "app:lock:sem/x/2");
        assert_eq!(s.lock_base, "app:lock:sem/x/");
        assert_eq!(s.fence_base, "app:fence:sem/x/");
        assert_eq!(s.lock_keys(2).queue, "app:queue:sem/x");
    }
}
