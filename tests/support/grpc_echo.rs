//! A real gRPC server and client (tonic, prost) for the proxy's gRPC tests: `echo.v1.Echo`
//! with one method of each call kind, written out as tonic's generated code would be.
//!
//! - `Say` (unary): the note back; a note `fail` ends the call `NOT_FOUND` with a message.
//! - `Count` (server streaming): `n` notes `text 1`..`text n`; with `text` `abort`, the call
//!   ends `ABORTED` after them (a status in trailers that follow data).
//! - `Collect` (client streaming): one note, the texts received joined with `,`, `n` their
//!   number.
//! - `Chat` (bidirectional): each note back as it arrives.
//!
//! Every note the server reads is appended to [`EchoServer::received`] as it arrives, so a
//! test can see exactly which messages reached the upstream, in order. The server also serves
//! `grpc.health.v1.Health` (serving, or not, as the test sets).

use futures::{Stream, StreamExt};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use tonic::codegen::{http, Body, BoxFuture, Service, StdError};
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};

/// The one message of `echo.v1`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Note {
    #[prost(string, tag = "1")]
    pub text: String,
    #[prost(uint32, tag = "2")]
    pub n: u32,
}

pub fn note(text: &str) -> Note {
    Note {
        text: text.to_string(),
        n: 0,
    }
}

pub const SAY: &str = "/echo.v1.Echo/Say";
pub const COUNT: &str = "/echo.v1.Echo/Count";
pub const COLLECT: &str = "/echo.v1.Echo/Collect";
pub const CHAT: &str = "/echo.v1.Echo/Chat";

type NoteStream = Pin<Box<dyn Stream<Item = Result<Note, Status>> + Send>>;

/// The echo service, with the log of what it read.
#[derive(Clone, Default)]
pub struct EchoServer {
    pub received: Arc<Mutex<Vec<String>>>,
}

impl EchoServer {
    fn log(&self, text: &str) {
        self.received.lock().unwrap().push(text.to_string());
    }

    pub fn received(&self) -> Vec<String> {
        self.received.lock().unwrap().clone()
    }

    /// Serves on `addr` (TLS with `tls`: certificate and key PEM), with the health service
    /// reporting `serving`, until the runtime ends.
    pub async fn serve(&self, addr: SocketAddr, tls: Option<(Vec<u8>, Vec<u8>)>, serving: bool) {
        let (reporter, health) = tonic_health::server::health_reporter();
        let status = if serving {
            tonic_health::ServingStatus::Serving
        } else {
            tonic_health::ServingStatus::NotServing
        };
        reporter.set_service_status("", status).await;
        let mut builder = tonic::transport::Server::builder();
        if let Some((cert, key)) = tls {
            builder = builder
                .tls_config(
                    tonic::transport::ServerTlsConfig::new()
                        .identity(tonic::transport::Identity::from_pem(cert, key)),
                )
                .unwrap();
        }
        let service = self.clone();
        tokio::spawn(async move {
            builder
                .add_service(health)
                .add_service(service)
                .serve(addr)
                .await
                .unwrap();
        });
        for _ in 0..100 {
            if tokio::net::TcpStream::connect(addr).await.is_ok() {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        panic!("echo server on {addr} never listened");
    }
}

impl tonic::server::NamedService for EchoServer {
    const NAME: &'static str = "echo.v1.Echo";
}

struct SaySvc(EchoServer);
impl tonic::server::UnaryService<Note> for SaySvc {
    type Response = Note;
    type Future = BoxFuture<Response<Note>, Status>;
    fn call(&mut self, request: Request<Note>) -> Self::Future {
        let server = self.0.clone();
        Box::pin(async move {
            let note = request.into_inner();
            server.log(&note.text);
            if note.text == "fail" {
                return Err(Status::not_found("no note called fail"));
            }
            Ok(Response::new(note))
        })
    }
}

struct CountSvc(EchoServer);
impl tonic::server::ServerStreamingService<Note> for CountSvc {
    type Response = Note;
    type ResponseStream = NoteStream;
    type Future = BoxFuture<Response<NoteStream>, Status>;
    fn call(&mut self, request: Request<Note>) -> Self::Future {
        let server = self.0.clone();
        Box::pin(async move {
            let note = request.into_inner();
            server.log(&note.text);
            let text = note.text.clone();
            let mut items: Vec<Result<Note, Status>> = (1..=note.n)
                .map(|i| {
                    Ok(Note {
                        text: format!("{text} {i}"),
                        n: i,
                    })
                })
                .collect();
            if text == "abort" {
                items.push(Err(Status::aborted("counting aborted")));
            }
            Ok(Response::new(
                Box::pin(futures::stream::iter(items)) as NoteStream
            ))
        })
    }
}

struct CollectSvc(EchoServer);
impl tonic::server::ClientStreamingService<Note> for CollectSvc {
    type Response = Note;
    type Future = BoxFuture<Response<Note>, Status>;
    fn call(&mut self, request: Request<Streaming<Note>>) -> Self::Future {
        let server = self.0.clone();
        Box::pin(async move {
            let mut stream = request.into_inner();
            let mut texts = Vec::new();
            while let Some(note) = stream.message().await? {
                server.log(&note.text);
                texts.push(note.text);
            }
            Ok(Response::new(Note {
                text: texts.join(","),
                n: texts.len() as u32,
            }))
        })
    }
}

struct ChatSvc(EchoServer);
impl tonic::server::StreamingService<Note> for ChatSvc {
    type Response = Note;
    type ResponseStream = NoteStream;
    type Future = BoxFuture<Response<NoteStream>, Status>;
    fn call(&mut self, request: Request<Streaming<Note>>) -> Self::Future {
        let server = self.0.clone();
        Box::pin(async move {
            let stream = request.into_inner();
            let out = stream.map(move |item| {
                let note = item?;
                server.log(&note.text);
                Ok(note)
            });
            Ok(Response::new(Box::pin(out) as NoteStream))
        })
    }
}

impl<B> Service<http::Request<B>> for EchoServer
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let server = self.clone();
        let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::<Note, Note>::default());
        match req.uri().path() {
            SAY => Box::pin(async move { Ok(grpc.unary(SaySvc(server), req).await) }),
            COUNT => {
                Box::pin(async move { Ok(grpc.server_streaming(CountSvc(server), req).await) })
            }
            COLLECT => {
                Box::pin(async move { Ok(grpc.client_streaming(CollectSvc(server), req).await) })
            }
            CHAT => Box::pin(async move { Ok(grpc.streaming(ChatSvc(server), req).await) }),
            _ => Box::pin(async move { Ok(Status::unimplemented("no such method").into_http()) }),
        }
    }
}

/// A client of `echo.v1.Echo`.
#[derive(Clone)]
pub struct EchoClient {
    grpc: tonic::client::Grpc<Channel>,
}

impl EchoClient {
    /// Over h2c to `addr`.
    pub async fn h2c(addr: SocketAddr) -> EchoClient {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        EchoClient {
            grpc: tonic::client::Grpc::new(channel),
        }
    }

    /// Over TLS (ALPN h2) to `addr`, verifying `name` against `ca_pem`.
    pub async fn tls(addr: SocketAddr, name: &str, ca_pem: &[u8]) -> EchoClient {
        let tls = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(ca_pem))
            .domain_name(name);
        let channel = tonic::transport::Endpoint::from_shared(format!("https://{addr}"))
            .unwrap()
            .tls_config(tls)
            .unwrap()
            .connect()
            .await
            .unwrap();
        EchoClient {
            grpc: tonic::client::Grpc::new(channel),
        }
    }

    fn codec() -> tonic_prost::ProstCodec<Note, Note> {
        tonic_prost::ProstCodec::default()
    }

    pub async fn say(&mut self, text: &str) -> Result<Note, Status> {
        self.grpc.ready().await.unwrap();
        let path = http::uri::PathAndQuery::from_static(SAY);
        self.grpc
            .unary(Request::new(note(text)), path, Self::codec())
            .await
            .map(Response::into_inner)
    }

    /// The notes of a `Count` call and how it ended, with its trailers.
    pub async fn count(
        &mut self,
        text: &str,
        n: u32,
    ) -> (
        Vec<Note>,
        Result<Option<tonic::metadata::MetadataMap>, Status>,
    ) {
        self.grpc.ready().await.unwrap();
        let path = http::uri::PathAndQuery::from_static(COUNT);
        let request = Request::new(Note {
            text: text.to_string(),
            n,
        });
        let mut stream = match self
            .grpc
            .server_streaming(request, path, Self::codec())
            .await
        {
            Ok(response) => response.into_inner(),
            Err(status) => return (Vec::new(), Err(status)),
        };
        let mut notes = Vec::new();
        loop {
            match stream.message().await {
                Ok(Some(note)) => notes.push(note),
                Ok(None) => return (notes, stream.trailers().await),
                Err(status) => return (notes, Err(status)),
            }
        }
    }

    pub async fn collect(&mut self, texts: &[&str]) -> Result<Note, Status> {
        self.grpc.ready().await.unwrap();
        let path = http::uri::PathAndQuery::from_static(COLLECT);
        let notes: Vec<Note> = texts.iter().map(|t| note(t)).collect();
        self.grpc
            .client_streaming(
                Request::new(futures::stream::iter(notes)),
                path,
                Self::codec(),
            )
            .await
            .map(Response::into_inner)
    }

    /// A `Chat` in turns: each text sent once the previous one came back. The texts that came
    /// back, and how the call ended.
    pub async fn chat(&mut self, texts: &[&str]) -> (Vec<String>, Result<(), Status>) {
        self.grpc.ready().await.unwrap();
        let path = http::uri::PathAndQuery::from_static(CHAT);
        let (tx, rx) = futures::channel::mpsc::unbounded::<Note>();
        let mut echoed = Vec::new();
        let mut texts = texts.iter();
        if let Some(first) = texts.next() {
            tx.unbounded_send(note(first)).unwrap();
        }
        let mut stream = match self
            .grpc
            .streaming(Request::new(rx), path, Self::codec())
            .await
        {
            Ok(response) => response.into_inner(),
            Err(status) => return (echoed, Err(status)),
        };
        loop {
            match stream.message().await {
                Ok(Some(back)) => {
                    echoed.push(back.text);
                    match texts.next() {
                        Some(next) => tx.unbounded_send(note(next)).unwrap(),
                        None => tx.close_channel(),
                    }
                }
                Ok(None) => return (echoed, Ok(())),
                Err(status) => return (echoed, Err(status)),
            }
        }
    }
}
