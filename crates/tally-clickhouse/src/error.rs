//! What a ClickHouse statement, a schema check or a row can fail with.

#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error("clickhouse {url}: {context}: {}", describe(source))]
    Server {
        url: String,
        context: String,
        source: clickhouse::error::Error,
    },
    #[error("clickhouse schema: {0}")]
    Schema(String),
    #[error("clickhouse: {0}")]
    Refused(String),
    /// A row does not fit the job's data table (its key parts or value words do not match the
    /// shape's columns): no retry can write it.
    #[error("clickhouse: cannot write a row of the job's shape: {0}")]
    Row(String),
    /// A later generation of the read side dropped this one's database: it holds the read
    /// side no more, and the server refused its statement.
    #[error("clickhouse: read side generation {generation} was fenced by a later one: {detail}")]
    Fenced { generation: u64, detail: String },
}

pub type Result<T, E = SinkError> = std::result::Result<T, E>;

/// The error and its causes on one line: `client error (Connect)` alone says nothing.
fn describe(error: &clickhouse::error::Error) -> String {
    let mut text = error.to_string();
    let mut next = std::error::Error::source(error);
    while let Some(cause) = next {
        let part = cause.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        next = cause.source();
    }
    text
}
