-- The proxy database schema of fedpca 0.2.0 (schema version 3), for migration tests.
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS owners (
    owner_id TEXT PRIMARY KEY,
    first_seen REAL NOT NULL,
    last_seen REAL NOT NULL,
    info TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS queries (
    query_id TEXT PRIMARY KEY,
    analyst_id TEXT NOT NULL,
    spec TEXT NOT NULL,
    plan TEXT NOT NULL,
    state TEXT NOT NULL,
    created_at REAL NOT NULL,
    deadline_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    n_contributed INTEGER NOT NULL DEFAULT 0,
    failure_reason TEXT,
    signature BLOB NOT NULL DEFAULT x'',
    signer TEXT NOT NULL DEFAULT '',
    uploads_begun INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS uploads (
    query_id TEXT NOT NULL REFERENCES queries(query_id),
    owner_id TEXT NOT NULL,
    upload_id TEXT NOT NULL,
    content_sha256 TEXT NOT NULL,
    n_ciphertexts INTEGER NOT NULL,
    public_count INTEGER,
    accepted_at REAL NOT NULL,
    PRIMARY KEY (query_id, owner_id)
);
CREATE UNIQUE INDEX IF NOT EXISTS uploads_content ON uploads(content_sha256);
CREATE TABLE IF NOT EXISTS declines (
    query_id TEXT NOT NULL REFERENCES queries(query_id),
    owner_id TEXT NOT NULL,
    reason TEXT NOT NULL,
    declined_at REAL NOT NULL,
    PRIMARY KEY (query_id, owner_id)
);
CREATE TABLE IF NOT EXISTS aggregate_pages (
    query_id TEXT NOT NULL REFERENCES queries(query_id),
    page INTEGER NOT NULL,
    n_folded INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (query_id, page)
);
CREATE TABLE IF NOT EXISTS upload_chunks (
    query_id TEXT NOT NULL REFERENCES queries(query_id),
    owner_id TEXT NOT NULL,
    upload_id TEXT NOT NULL,
    stream INTEGER NOT NULL,
    start_index INTEGER NOT NULL,
    total INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (query_id, owner_id, stream, start_index)
);
CREATE TABLE IF NOT EXISTS results (
    query_id TEXT NOT NULL REFERENCES queries(query_id),
    block TEXT NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (query_id, block)
);
CREATE TABLE IF NOT EXISTS result_meta (
    query_id TEXT PRIMARY KEY REFERENCES queries(query_id),
    meta TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS analysts (
    analyst_id TEXT PRIMARY KEY,
    epsilon_budget REAL NOT NULL,
    delta_budget REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS releases (
    query_id TEXT PRIMARY KEY,
    analyst_id TEXT NOT NULL,
    event TEXT NOT NULL,
    recorded_at REAL NOT NULL
);
