//! One connection to Redis, to a single server or to a cluster: the one type the bucket store
//! ([`super::redis`]) and the fleet's policy source run their commands and scripts on.

use redis::aio::MultiplexedConnection;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, FromRedisValue, Pipeline, RedisResult, ScriptInvocation};

/// A connection of either kind; both clone cheaply. A single server's does not reconnect by
/// itself (its owner replaces it after a failure); a cluster's does.
// Held in an `Arc` and cloned per call: boxing the larger variant would allocate per call.
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
pub enum RedisConn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl RedisConn {
    /// Runs one command (a cluster routes it by its key).
    pub async fn query<T: FromRedisValue>(&mut self, cmd: &Cmd) -> RedisResult<T> {
        match self {
            RedisConn::Single(c) => cmd.query_async(c).await,
            RedisConn::Cluster(c) => cmd.query_async(c).await,
        }
    }

    /// Runs a script invocation (by its hash, loading it when the server lacks it).
    pub async fn invoke<T: FromRedisValue>(
        &mut self,
        invocation: &ScriptInvocation<'_>,
    ) -> RedisResult<T> {
        match self {
            RedisConn::Single(c) => invocation.invoke_async(c).await,
            RedisConn::Cluster(c) => invocation.invoke_async(c).await,
        }
    }

    /// Runs a pipeline.
    pub async fn pipe<T: FromRedisValue>(&mut self, pipe: &Pipeline) -> RedisResult<T> {
        match self {
            RedisConn::Single(c) => pipe.query_async(c).await,
            RedisConn::Cluster(c) => pipe.query_async(c).await,
        }
    }

    /// Whether this is a cluster's connection (keys must then share a slot per call).
    pub fn is_cluster(&self) -> bool {
        matches!(self, RedisConn::Cluster(_))
    }
}
