import SwiftUI
import UniformTypeIdentifiers

/// The transcript, an input field, a button to start a new conversation and, on macOS, one to open
/// an export folder.
struct ChatView: View {
    @StateObject private var session = ChatSession()
    @State private var draft = ""
    @State private var choosingFolder = false

    var body: some View {
        VStack(spacing: 0) {
            ScrollViewReader { proxy in
                ScrollView {
                    LazyVStack(alignment: .leading, spacing: 12) {
                        ForEach(session.lines) { line in
                            Text(line.text.isEmpty ? "…" : line.text)
                                .padding(10)
                                .background(line.role == "user" ? Color.accentColor.opacity(0.15) : Color.secondary.opacity(0.1))
                                .clipShape(RoundedRectangle(cornerRadius: 10))
                                .frame(maxWidth: .infinity, alignment: line.role == "user" ? .trailing : .leading)
                                .id(line.id)
                        }
                    }
                    .padding()
                }
                .onChange(of: session.lines.last?.text) { _ in
                    if let last = session.lines.last { proxy.scrollTo(last.id, anchor: .bottom) }
                }
            }
            Divider()
            HStack {
                TextField("Message", text: $draft)
                    .textFieldStyle(.roundedBorder)
                    .onSubmit(send)
                    .disabled(!session.isReady)
                if session.isBusy && session.isReady {
                    Button("Stop", action: session.stop)
                } else {
                    Button("Send", action: send).disabled(!session.isReady || draft.isEmpty)
                }
            }
            .padding()
            HStack {
                Text(session.status).font(.caption).foregroundStyle(.secondary).lineLimit(2)
                Spacer()
                Button("New Chat", action: session.startOver).font(.caption).disabled(!session.isReady)
                Button("Open Export…") { choosingFolder = true }.font(.caption)
            }
            .padding([.horizontal, .bottom])
        }
        .fileImporter(isPresented: $choosingFolder, allowedContentTypes: [.folder]) { result in
            guard case let .success(url) = result else { return }
            // Files chosen by the user stay readable for as long as the app runs.
            _ = url.startAccessingSecurityScopedResource()
            Task { await session.load(url) }
        }
        .task {
            if let bundled = ChatSession.bundledExport { await session.load(bundled) }
        }
    }

    private func send() {
        let text = draft.trimmingCharacters(in: .whitespacesAndNewlines)
        guard !text.isEmpty else { return }
        draft = ""
        session.send(text)
    }
}
