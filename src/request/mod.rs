//! What a request is, as the gateway reads it: its facts and descriptors (`descriptor`), its
//! authority taken apart into host and port (`authority`), the client's address behind trusted
//! proxies (`client_addr`), the network facts of an address (`network`: CIDR lists, ASN and
//! country files), the forwarding headers sent upstream (`forwarding`), JWT claims (`auth`), an
//! LLM request's tokens (`llm`, `llm_encoding`), and the request-line and `Host` shapes refused
//! before any matching (`syntax`).

pub mod auth;
pub mod authority;
pub mod client_addr;
pub mod descriptor;
pub mod forwarding;
pub mod grpc;
pub mod llm;
pub mod llm_encoding;
pub mod network;
pub mod syntax;
