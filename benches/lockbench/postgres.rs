//! postgres rows (filled in by the postgres adapter).
use crate::Row;
pub async fn run(_iters: usize) -> Vec<Row> {
    Vec::new()
}
