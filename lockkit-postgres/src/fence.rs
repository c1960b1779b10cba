//! [`PgFence`]: fenced updates of data kept in PostgreSQL.

use lockkit_core::backend::LeaseFence;
use lockkit_core::{Error, FencingToken, Lease, Result};
use sqlx::postgres::PgArguments;
use sqlx::{Arguments, PgConnection};

use crate::error::{Msg, from_sqlx};

/// A fence for rows of one of **your** tables that carry a fencing-token column and a lock
/// column: an `UPDATE` that only touches rows bound to the writer's lock whose stored token is
/// not newer than the writer's, and records the writer's token and lock in them.
///
/// This is the check Kleppmann's storage service does ("reject a write with token 33 after one
/// with 34"), done by PostgreSQL in the caller's transaction: the same statement that writes the
/// data compares and stores the token, so no later holder can slip in between. The token may
/// come from any lockkit backend (a PostgreSQL table can be guarded by an etcd lock).
///
/// [`update`](Self::update) runs one statement that locks the rows matching your filter
/// (`SELECT … FOR UPDATE`), checks that all of them are bound to the token's lock (or to none
/// yet) and that none stores a newer token, and only then runs
///
/// ```sql
/// UPDATE {table} SET {set}, {token_column} = $t, {lock_column} = $l WHERE ({filter})
/// ```
///
/// where `$t` is the token's number and `$l` its lock ([`FencingToken::lock`]), bound after
/// your own arguments. A row whose lock column is `NULL` has never been written under a fence
/// and is bound by its first fenced update to that update's lock; from then on a token of any
/// other lock fails with [`Error::ForeignToken`]. Equal tokens pass: the same holder may write
/// several times.
///
/// ```no_run
/// use lockkit_core::{Error, Lock, LockExt};
/// use lockkit_postgres::{PgFence, PgLock};
/// use sqlx::{Arguments, Connection, postgres::PgArguments};
/// # async fn f(locks: PgLock, mut db: sqlx::PgConnection) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// // CREATE TABLE reports (id int PRIMARY KEY, body text, fence_token bigint, fence_lock text);
/// let fence = PgFence::new("reports", "fence_token", "fence_lock")?;
/// let lease = locks.try_acquire("report-7", std::time::Duration::from_secs(10)).await?;
///
/// let mut tx = db.begin().await?;
/// let mut args = PgArguments::default();
/// args.add("new body")?; // $1
/// args.add(7_i32)?; // $2
/// // WRONG: UPDATE reports SET body = $1 WHERE id = $2   -- a paused holder overwrites a newer one
/// // RIGHT: the stale write fails with Error::StaleToken, changes nothing, and the lease is lost
/// match fence.update_as(&mut *tx, &lease, "body = $1", "id = $2", args).await {
///     Ok(_) => tx.commit().await?,
///     Err(e @ (Error::StaleToken { .. } | Error::ForeignToken { .. })) => {
///         // Roll back now, not by dropping `tx`: sqlx sends that ROLLBACK only when the
///         // connection is next used, and until then the rows stay locked for everyone.
///         tx.rollback().await?;
///         return Err(e.into());
///     }
///     Err(e) => return Err(e.into()),
/// }
/// lease.release().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct PgFence {
    table: String,
    /// `table`, folded to lower case and quoted, for the SQL text.
    table_sql: String,
    /// The token column, folded to lower case and quoted, for the SQL text.
    column_sql: String,
    /// The lock column, folded to lower case and quoted, for the SQL text.
    lock_column_sql: String,
}

impl PgFence {
    /// A fence on `table` (`name` or `schema.name`) whose token column is `token_column`
    /// (a `bigint`) and whose lock column is `lock_column` (`text`). All must be plain SQL
    /// identifiers (`[A-Za-z_][A-Za-z0-9_]*`); they are folded to lower case (as PostgreSQL
    /// does with unquoted names) and quoted, so reserved words such as `user` work.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if a name is not a plain identifier, or the two columns are one.
    pub fn new(table: &str, token_column: &str, lock_column: &str) -> Result<Self> {
        let parts: Vec<&str> = table.split('.').collect();
        if parts.len() > 2 || !parts.iter().all(|p| is_ident(p)) {
            return Err(Error::config(
                "fence table must be `name` or `schema.name` of plain SQL identifiers",
            ));
        }
        if !is_ident(token_column) || !is_ident(lock_column) {
            return Err(Error::config(
                "fence token and lock columns must be plain SQL identifiers",
            ));
        }
        if token_column.eq_ignore_ascii_case(lock_column) {
            return Err(Error::config(
                "fence token and lock columns must be two columns",
            ));
        }
        // Folding to lower case is what PostgreSQL does with unquoted names; quoting then lets
        // reserved words (`user`, `order`) through.
        let q = |p: &str| crate::core::quote_ident(&p.to_ascii_lowercase());
        Ok(Self {
            table: table.to_owned(),
            table_sql: parts.iter().map(|p| q(p)).collect::<Vec<_>>().join("."),
            column_sql: q(token_column),
            lock_column_sql: q(lock_column),
        })
    }

    /// Runs `UPDATE {table} SET {set} … WHERE ({filter})` if every row matching `filter` is
    /// bound to `token`'s lock (or to none yet) and none stores a token newer than `token`,
    /// stores `token` and its lock in them, and returns how many rows were updated. All or
    /// nothing: if any matching row fails a check, no row is changed.
    ///
    /// `set` and `filter` are SQL fragments written by you (never user input), using `$1…$n`
    /// for the values in `args`. `conn` is usually your transaction (`&mut tx`): the update
    /// commits or rolls back with it.
    ///
    /// # Errors
    /// - [`Error::ForeignToken`] if a row matching `filter` is bound to another lock
    ///   (`expected_lock` is one of them); nothing was changed.
    /// - [`Error::StaleToken`] if any row matching `filter` carries a newer token (`current`
    ///   is the newest); nothing was changed.
    /// - [`Error::Backend`] for an SQL error (the transaction is then aborted, as usual), or
    ///   [`Error::Unavailable`] if the connection broke.
    ///
    /// If no row matches `filter` at all, `Ok(0)` is returned: that is not a stale write.
    ///
    /// # Cancel safety
    /// As cancel safe as a sqlx statement: if dropped, the update may or may not have run in
    /// the transaction; roll the transaction back (dropping a sqlx `Transaction` does too, but
    /// only when the connection is next used: until then the matching rows stay locked).
    pub async fn update(
        &self,
        conn: &mut PgConnection,
        token: FencingToken,
        set: &str,
        filter: &str,
        args: PgArguments,
    ) -> Result<u64> {
        let t = i64::try_from(token.get())
            .map_err(|_| Error::config("fencing token does not fit a bigint"))?;
        let n = args.len() + 1;
        let l = n + 1;
        let (table, col, lcol) = (&self.table_sql, &self.column_sql, &self.lock_column_sql);
        // One statement, all or nothing: lock the matching rows, check that all are bound to
        // our lock (or none) and none carries a newer token, and update them only if so.
        let sql = format!(
            "WITH m AS (SELECT {col} AS t, {lcol} AS l FROM {table} WHERE ({filter}) FOR UPDATE), \
                  c AS (SELECT coalesce(bool_and(l IS NULL OR l = ${l}), true) AS mine, \
                               min(l) FILTER (WHERE l <> ${l}) AS other, \
                               coalesce(bool_and(t IS NULL OR t <= ${n}), true) AS fresh, \
                               max(t) AS newest FROM m), \
                  u AS (UPDATE {table} SET {set}, {col} = ${n}, {lcol} = ${l} \
                        WHERE ({filter}) AND (SELECT mine AND fresh FROM c) RETURNING 1) \
             SELECT (SELECT count(*) FROM u), c.mine, c.other, c.fresh, c.newest FROM c"
        );
        let mut all = args;
        all.add(t)
            .map_err(|e| Error::config_with("cannot encode the fencing token", e))?;
        all.add(token.lock())
            .map_err(|e| Error::config_with("cannot encode the fencing token's lock", e))?;
        let (done, mine, other, fresh, newest): (i64, bool, Option<String>, bool, Option<i64>) =
            sqlx::query_as_with(&sql, all)
                .fetch_one(&mut *conn)
                .await
                .map_err(from_sqlx)?;
        if !mine {
            return Err(Error::ForeignToken {
                resource: self.table.clone(),
                expected_lock: other.unwrap_or_default(),
                token,
            });
        }
        if fresh {
            return Ok(u64::try_from(done).unwrap_or(0));
        }
        let current = newest.unwrap_or(i64::MAX);
        Err(Error::StaleToken {
            resource: self.table.clone(),
            current: FencingToken::new(
                token.lock(),
                u64::try_from(current).map_err(|_| {
                    crate::error::backend(Msg("negative token in the fenced table".into()))
                })?,
            ),
            token,
        })
    }

    /// As [`update`](Self::update) with the token of `lease` (granted by any lockkit backend);
    /// if the update is rejected as stale (a newer grant of the lock wrote), `lease` becomes
    /// [`Lost`](lockkit_core::LeaseState::Lost) at once.
    ///
    /// # Errors
    /// As [`update`](Self::update).
    ///
    /// # Cancel safety
    /// As [`update`](Self::update).
    pub async fn update_as(
        &self,
        conn: &mut PgConnection,
        lease: &Lease,
        set: &str,
        filter: &str,
        args: PgArguments,
    ) -> Result<u64> {
        let fence = LeaseFence::new(lease);
        let res = self
            .update(conn, fence.token().clone(), set, filter, args)
            .await;
        fence.outcome(res)
    }

    /// The table this fence guards.
    pub fn table(&self) -> &str {
        &self.table
    }
}

fn is_ident(s: &str) -> bool {
    let mut c = s.chars();
    c.next()
        .is_some_and(|f| f.is_ascii_alphabetic() || f == '_')
        && c.all(|x| x.is_ascii_alphanumeric() || x == '_')
        && s.len() <= 63
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        PgFence::new("reports", "fence_token", "fence_lock").unwrap();
        PgFence::new("app.reports", "tok", "lck").unwrap();
        for (t, c) in [
            ("", "t"),
            ("a.b.c", "t"),
            ("x; drop", "t"),
            ("r", "t t"),
            ("\"r\"", "t"),
            ("r", "L"),
        ] {
            assert!(PgFence::new(t, c, "l").is_err(), "{t} {c}");
        }
    }
}
