import SwiftUI

/// A minimal chat app around an export made by `llama-ane export`.
@main
struct LlamaANEChatApp: App {
    var body: some Scene {
        WindowGroup {
            ChatView()
        }
    }
}
